"""Steered sessions and prompt events in a serving group without tritonserver (launch/local_group, SP2 over
gloo): what the group does with them, on every rank alike. What only Triton does with them (its sequence
batcher, its START flag, the client over gRPC) is tested in test_steering.py."""
from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

from backend.api.codec import request_arrays
from backend.api.contract import SEQUENCE_START
from backend.api.controls import integrate, parse_key_script
from backend.api.request import Controls, SessionRequest
from backend.serving.settings import ServingSettings
from backend.launch.local_group import LocalGroup, LocalStreamError
from conftest import GROUP_IDLE_S
from factories import forward_poses, tiny_settings, tiny_request
from polling import wait_until

pytestmark = pytest.mark.server  # starts groups of processes


def steered(controls: Controls, seed: int = 42, **changes) -> SessionRequest:
    base = tiny_request(num_frames=9, seed=seed, decode=False)
    return dataclasses.replace(base, num_frames=None, poses=controls.poses, keys=controls.keys, **changes)


def play(group: LocalGroup, steps: list[Controls], seed: int = 42, rank: int = 0, **changes) -> np.ndarray:
    """Steer a session through `steps` (the first is the first block's camera), one block per request; its
    latents along the frames."""
    session = group.steered(steered(steps[0], seed, **changes), rank)
    blocks = [session.next_block()]
    for i, controls in enumerate(steps[1:], start=1):
        session.step(controls, end=i == len(steps) - 1)
        blocks.append(session.next_block())
    assert [b.block_index for b in blocks] == list(range(len(steps)))
    return np.concatenate([b.latents for b in blocks], axis=1)


def pose_steps(poses: np.ndarray) -> list[Controls]:
    return [Controls(poses=poses[:9])] + [Controls(poses=poses[i : i + 12]) for i in range(9, len(poses), 12)]


def test_a_long_session_streams_every_block_once_in_order(sp2_group) -> None:
    window_blocks = 3  # the tiny checkpoint's 9-frame window
    latents = play(sp2_group, [Controls(keys="w")] * (3 * window_blocks), rank=1)
    assert latents.shape == (4, 3 * 3 * window_blocks, 8, 8)


def test_whole_trajectory_and_steps_give_identical_latents(sp2_group, engine) -> None:
    poses = forward_poses(57, step=0.25)  # constant speed: the running scale is the clip's from block 0 on
    request = tiny_request(num_frames=57, poses=poses, decode=False)
    whole = np.concatenate([b.latents for b in sp2_group.stream(request, rank=1)], axis=1)
    assert np.array_equal(whole, play(sp2_group, pose_steps(poses)))
    alone = np.concatenate([o.latents[0].numpy() for o, _ in engine.generate(request, decode=False)], axis=1)
    assert np.array_equal(whole, alone)  # SP2 served == SP1 direct, bit for bit


def test_a_key_script_equals_the_poses_it_integrates_to(sp2_group) -> None:
    keys = parse_key_script("w*2,wj,d")
    first = np.concatenate([np.eye(4, dtype=np.float32)[None], integrate(np.eye(4), keys[0], 8)])
    poses = [first]
    for k in keys[1:]:
        poses.append(integrate(poses[-1][-1], k, 12))
    by_keys = play(sp2_group, [Controls(keys=k) for k in keys])
    assert np.array_equal(by_keys, play(sp2_group, [Controls(poses=p) for p in poses], rank=1))


def test_two_events_give_the_same_bits_on_either_owner_as_on_one_rank(sp2_group, engine) -> None:
    from backend.engine.blocks import BlockControls

    steps = [Controls(keys="w"), Controls(keys="w", prompt="it starts to snow"), Controls(keys="d"),
             Controls(keys="d", prompt="a castle in the forest"), Controls(keys="w")]
    served = [play(sp2_group, steps, rank=r) for r in (0, 1)]
    with engine.session(steered(steps[0])) as session:
        alone = []
        for controls in [Controls(keys="w")] + steps[1:]:
            if controls.prompt is not None:
                engine.set_prompt(session, controls.prompt)
            alone.append(engine.run_block([session], {session.id: BlockControls(controls)})[0].latents[0].numpy())
    assert np.array_equal(served[0], served[1]) and np.array_equal(served[0], np.concatenate(alone, axis=1))


def test_an_idle_session_expires_on_every_rank_and_frees_its_caches(sp2_group) -> None:
    session = sp2_group.steered(steered(Controls(keys="w")), rank=1)  # no pause held open
    assert session.next_block().block_index == 0
    wait_until(lambda: all(sp2_group.call(r, "sp_workers:open_sessions") == 0 for r in (0, 1)), GROUP_IDLE_S + 30,
               "the idle session to expire on both ranks")
    with pytest.raises(LocalStreamError, match=r"^\[EXPIRED\] no running session \d+: the session sent no step for "
                                               r"session_idle_timeout_s=4 s and was ended; start a new one"):
        session.step(Controls(keys="w")).next()


def test_hold_keeps_playing_and_flags_held_blocks(sp2_group) -> None:
    session = sp2_group.steered(steered(Controls(keys="d"), on_starve="hold"), rank=1)
    assert not session.next_block().held
    # No step sent: the session repeats its last motion for one block ahead, then waits.
    wait_until(lambda: 2 in sp2_group.call(0, "sp_workers:planned_blocks").values(), 60, "a held block")
    session.step(Controls(keys="d"))
    late = session.next_block()
    assert late.held and late.block_index == 1
    session.step(Controls(keys="d"), end=True)
    last = session.next_block()
    assert not last.held and last.block_index == 2


def test_a_cancelled_session_leaves_the_others_running_then_a_third_plays(sp2_group) -> None:
    a = sp2_group.steered(steered(Controls(keys="w"), seed=1), rank=0)
    b = sp2_group.steered(steered(Controls(keys="a"), seed=2), rank=1)
    assert a.next_block().block_index == 0 and b.next_block().block_index == 0
    a.step(Controls(keys="w")).cancel()  # its client goes away mid-session
    b.step(Controls(keys="a"))
    assert b.next_block().block_index == 1
    wait_until(lambda: sum(sp2_group.call(r, "sp_workers:open_sessions") for r in (0, 1)) == 2, 30,
               "the cancelled session to free its caches on both ranks (b's stay)")
    b.step(Controls(keys="a"), end=True)
    assert b.next_block().block_index == 2
    assert play(sp2_group, [Controls(keys="s")] * 2, seed=3).shape[1] == 6


def test_bad_steps_get_clear_errors_and_the_session_goes_on(sp2_group) -> None:
    session = sp2_group.steered(steered(Controls(keys="w")), rank=1)
    session.next_block()
    with pytest.raises(LocalStreamError, match=r"^\[INVALID_INPUT\] camera_poses must be FP32 \[12, 4, 4\]; got "
                                               r"float32 \[5, 4, 4\]"):
        session.step(Controls(poses=forward_poses(5))).next()
    with pytest.raises(LocalStreamError, match=r"action 'wq' holds unknown key\(s\) \['q'\]"):
        sp2_group.request(1, {"action": np.array([b"wq"], dtype=object)}, {}, session.key).next()
    again = sp2_group.request(1, request_arrays(steered(Controls(keys="w"))), {}, session.key, SEQUENCE_START)
    with pytest.raises(LocalStreamError, match=r"^\[SESSION_EXISTS\] session \d+ is already running"):
        again.next()
    session.step(Controls(keys="w"), end=True)
    assert session.next_block().block_index == 1
    with pytest.raises(LocalStreamError, match=r"^\[SESSION_UNKNOWN\] no running session \d+: it (was )?ended by its "):
        session.step(Controls(keys="w")).next()


def test_a_session_lives_at_most_max_session_s(tiny_checkpoint: str) -> None:
    settings = tiny_settings(tiny_checkpoint, decode_frames=False)
    with LocalGroup(settings, ServingSettings(max_session_s=3.0), ranks=1) as group:
        session = group.steered(steered(Controls(keys="w")))
        session.next_block()
        deadline = time.monotonic() + 30
        with pytest.raises(LocalStreamError, match=r"^\[EXPIRED\] .*max_session_s=3 s"):
            while time.monotonic() < deadline:  # keep stepping: the cap, not idleness, ends it
                session.step(Controls(keys="w"))
                session.next_block()


def test_a_recache_event_takes_hold_at_once_and_equals_one_rank_bit_for_bit(sp2_group, engine) -> None:
    """A prompt event with recache: its cache is recomputed under the new prompt at a boundary of its own, on
    both ranks alike; the served latents equal the SP1 engine's set_prompt + recache, bit for bit, and differ
    from the same event without recache from that block on."""
    from backend.engine.blocks import BlockControls

    def steps(recache: bool) -> list[Controls]:
        return [Controls(keys="w"), Controls(keys="w"), Controls(keys="d", prompt="it starts to snow", recache=recache),
                Controls(keys="d")]

    served = {}
    for recache in (True, False):
        session = sp2_group.steered(steered(steps(recache)[0]), rank=1)
        blocks = [session.next_block()]
        for i, controls in enumerate(steps(recache)[1:], start=1):
            session.step(controls, end=i == 3)
            blocks.append(session.next_block())
        assert [b.recached for b in blocks] == [False, False, recache, False]
        assert [b.prompt for b in blocks][2:] == ["it starts to snow"] * 2
        served[recache] = np.concatenate([b.latents for b in blocks], axis=1)
    with engine.session(steered(Controls(keys="w")), keep_commits=True) as alone:
        direct = []
        for controls in steps(True):
            if controls.prompt is not None:
                engine.set_prompt(alone, controls.prompt)
                engine.recache(alone)
            direct.append(engine.run_block([alone], {alone.id: BlockControls(controls)})[0].latents[0].numpy())
    assert np.array_equal(served[True], np.concatenate(direct, axis=1))
    assert np.array_equal(served[True][:, :6], served[False][:, :6])  # before the event: the same
    assert not np.array_equal(served[True][:, 6:], served[False][:, 6:])  # from the event on: the cache differs


def test_a_recache_without_its_event_or_under_global_attention_is_refused(sp2_group, tiny_checkpoint: str) -> None:
    session = sp2_group.steered(steered(Controls(keys="w")), rank=0)
    session.next_block()
    with pytest.raises(LocalStreamError, match=r"'recache' rides on a prompt event: send it with 'prompt'"):
        session.step(Controls(keys="w"), recache=True).next()
    session.step(None, end=True).next()
    settings = tiny_settings(tiny_checkpoint, decode_frames=False, window_frames=-1)
    with LocalGroup(settings, ServingSettings(), ranks=1) as group:
        bounded = group.steered(steered(Controls(keys="w"), max_blocks=4))
        bounded.next_block()
        with pytest.raises(LocalStreamError, match=r"'recache' needs a sliding window: this server runs "
                                                   r"window_frames=-1"):
            bounded.step(Controls(keys="w", prompt="rain", recache=True)).next()


def test_waiting_sessions_are_told_their_place_at_once_and_as_it_moves_and_a_full_queue_refuses(sp2_group) -> None:
    """3 slots (sp2_group's max_sessions), 16 places (max_queue): each waiting session hears its place as soon as
    it is in the queue, a client that leaves is out of the queue at once and those behind move up, a freed slot goes to
    the first in the queue (place 0, then its first block), and the 20th start is refused with its retry time."""
    held = [sp2_group.steered(steered(Controls(keys="w"), seed=i), rank=i % 2) for i in range(3)]
    for session in held:
        assert session.next_block().block_index == 0
    pauses = [session.pause() for session in held]  # the 3 slots stay taken: a pause stops the idle clock
    line = [sp2_group.steered(steered(Controls(keys="a"), seed=10 + i), rank=1) for i in range(17)]  # one owner:
    # the line is in arrival order (a boundary's submissions are taken in rank order)
    started = time.monotonic()
    places = [session.call.next(30, places=True) for session in line[:16]]
    assert [p.position for p in places] == list(range(1, 17)), places
    assert time.monotonic() - started < 5, "the places came late"
    with pytest.raises(LocalStreamError, match=r"^\[CAPACITY_EXHAUSTED retry_after_s=\d+\] server busy: 16 sessions "
                                               r"already wait for a slot"):
        line[16].next_block()
    line[1].call.cancel()  # the 2nd in the queue leaves: the 3rd and later move up at once, the 1st stays
    assert line[2].call.next(30, places=True).position == 2 and line[15].call.next(30, places=True).position == 15
    held[0].step(Controls(keys="w"), end=True)  # a slot frees after its last block
    assert held[0].next_block().block_index == 1
    assert line[0].call.next(30, places=True).position == 0 and line[0].next_block().block_index == 0
    assert line[2].call.next(30, places=True).position == 1
    for call in pauses[1:] + [session.call for session in line[2:16]]:
        call.cancel()  # line[0] ends at its idle limit
    wait_until(lambda: all(sp2_group.call(r, "sp_workers:open_sessions") == 0 for r in (0, 1)), 60,
               "every session to end on both ranks")
