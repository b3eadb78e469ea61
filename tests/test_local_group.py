"""A serving group without tritonserver (launch/local_group): N members as local processes over gloo take
requests as Triton hands them over, through the same parse, admission, group loop and streams."""
from __future__ import annotations

import dataclasses
import os
import signal
import time

import numpy as np
import pytest

from backend.api.codec import request_arrays, request_parameters
from backend.api.contract import SEQUENCE_END, SEQUENCE_START
from backend.api.request import Controls
from backend.model.memory import weight_parameters
from backend.serving.settings import ServingSettings
from backend.launch.local_group import LocalGroup, LocalStreamError
from factories import tiny_settings, tiny_request
from polling import wait_until

pytestmark = pytest.mark.server  # starts groups of processes


def test_a_start_is_validated_once_on_its_owner_and_opened_on_every_rank(sp2_group, engine) -> None:
    before = [sp2_group.call(r, "sp_workers:admission_counts") for r in range(2)]
    request = tiny_request(num_frames=21, decode=False)
    blocks = sp2_group.stream(request, rank=1)
    after = [sp2_group.call(r, "sp_workers:admission_counts") for r in range(2)]
    delta = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before)]
    assert delta[1] == {"check_request": 1, "request_geometry": 1, "open_session": 1}  # the owner: parsed, admitted
    assert delta[0] == {"check_request": 0, "request_geometry": 0, "open_session": 1}  # the other rank: opens only
    expected = np.concatenate([o.latents[0].numpy() for o, _ in engine.generate(request, decode=False)], axis=1)
    assert np.array_equal(np.concatenate([b.latents for b in blocks], axis=1), expected)  # SP2 == SP1, bit for bit
    assert [b.block_index for b in blocks] == [0, 1] and blocks[-1].final


def test_a_refused_start_is_refused_by_its_owner_alone_naming_the_input(sp2_group) -> None:
    before = [sp2_group.call(r, "sp_workers:admission_counts") for r in range(2)]
    with pytest.raises(LocalStreamError, match=r"num_frames=13 gives 4 latent frames, not a multiple of block_frames"):
        sp2_group.stream(tiny_request(num_frames=13), rank=0)
    after = [sp2_group.call(r, "sp_workers:admission_counts") for r in range(2)]
    assert after[1] == before[1] and after[0]["open_session"] == before[0]["open_session"]


def test_a_steered_session_on_either_rank_plays_and_ends(sp2_group) -> None:
    first = dataclasses.replace(tiny_request(num_frames=9, decode=False), num_frames=None, poses=None, keys="w")
    for rank in (0, 1):
        session = sp2_group.steered(first, rank=rank)
        assert session.next_block().block_index == 0
        session.step(Controls(keys="d"))
        assert session.next_block().block_index == 1
        session.step(None, end=True)
        assert session.next_block() is None  # an end flag alone: an empty final response
        late = session.step(Controls(keys="w"))
        with pytest.raises(LocalStreamError, match=r"no running session \d+: it ended by its client"):
            late.next()


def test_tp2_x_sp2_serves_two_owners_at_once_within_float32_rounding(tiny_checkpoint: str, engine) -> None:
    """Four members, one rank each: two TP groups of two inside an SP2 group, each request owned by another."""
    request = tiny_request()
    direct = engine.generate(request)
    expected = np.concatenate([out.latents[0].numpy() for out, _ in direct], axis=1)
    expected_frames = np.concatenate([f for _, f in direct]).astype(int)
    settings = tiny_settings(tiny_checkpoint, sp_degree=2, tp_degree=2)
    with LocalGroup(settings, ServingSettings(max_batch=1, collective_timeout_s=60.0), ranks=4) as group:
        calls = [group.request(rank, *whole_trajectory(group, request)) for rank in (1, 3)]
        results = [call.blocks(240) for call in calls]
        weights = [group.call(r, "sp_workers:weight_bytes") for r in range(4)]
    for blocks in results:
        assert [b.block_index for b in blocks] == list(range(5))
        # Row-parallel sums in another order than SP1's: float32 rounding, not bit-identical.
        assert np.abs(np.concatenate([b.latents for b in blocks], axis=1) - expected).max() < 1e-5
        assert np.abs(np.concatenate([b.frames for b in blocks]).astype(int) - expected_frames).max() <= 1
    assert weights == [weight_parameters(engine.ckpt.transformer, 2) * 4] * 4  # float32: a half of each split


def whole_trajectory(group: LocalGroup, request) -> tuple:
    """A whole trajectory's request as the client sends it: arrays, parameters, its own sequence, start and end."""
    return (request_arrays(request), request_parameters(request), group.new_sequence(), SEQUENCE_START | SEQUENCE_END)


def test_a_hung_rank_is_detected_in_bounded_time_and_the_survivor_errors_its_streams(tiny_checkpoint: str) -> None:
    """SIGSTOP: the peer neither answers nor closes its sockets (a dead one: test_robustness, through Triton)."""
    timeout_s = 5.0
    settings = tiny_settings(tiny_checkpoint, sp_degree=2, decode_frames=False)
    with LocalGroup(settings, ServingSettings(collective_timeout_s=timeout_s), ranks=2) as group:
        calls = [group.request(rank, *whole_trajectory(group, tiny_request(num_frames=129, seed=rank)))
                 for rank in (0, 1)]
        assert all(call.next(60).block_index == 0 for call in calls)  # both ranks own a running stream
        os.kill(group.pids[1], signal.SIGSTOP)
        started = time.monotonic()
        try:
            with pytest.raises(LocalStreamError, match="lost one of its model instances"):
                calls[0].blocks(timeout_s + 15)
            assert time.monotonic() - started < timeout_s + 15
            rank, why = group.events("failed", 30)  # the survivor tells its host
            assert rank == 0, why
            # The stopped member's own streams are lost with it: their clients see their timeout.
        finally:
            os.kill(group.pids[1], signal.SIGCONT)
            group.kill()


def test_an_idle_group_whose_store_host_dies_fails_at_once_not_at_its_heartbeat(tiny_checkpoint: str) -> None:
    """Rank 0 hosts the group's store: killed while the group sleeps on the doorbell, rank 1's loop wakes and fails
    within seconds (its sockets closed), not at its next heartbeat (collective_timeout_s / 2 = 60 s here). A group
    that waited out its heartbeat held a reload back for a minute: the healer unloaded rank 0's dead model while
    rank 1 still lived, and the new rank 1 was refused its host claim."""
    settings = tiny_settings(tiny_checkpoint, sp_degree=2, decode_frames=False)
    with LocalGroup(settings, ServingSettings(collective_timeout_s=120.0), ranks=2) as group:
        assert len(group.stream(tiny_request(num_frames=9), rank=1)) == 1  # served, then idle
        wait_until(lambda: group.call(1, "sp_workers:loop_sleeps"), 10, "rank 1 asleep on the doorbell")
        try:
            os.kill(group.pids[0], signal.SIGKILL)
            killed = time.monotonic()
            rank, why = group.events("failed", 20)
            assert rank == 1 and time.monotonic() - killed < 10, why
        finally:
            group.kill()
