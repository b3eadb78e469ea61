"""Recache: after a prompt event the self-attention cache is recomputed under the new prompt (tiny checkpoint:
3-frame blocks, a 9-frame window, a 3-frame sink, 16 tokens a frame). The ground truth is the normal block path,
teacher-forced: a session whose commits were all under the new prompt, committing the event run's latents."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from backend.api.contract import video_frames_for
from backend.api.errors import InputError
from backend.api.request import SessionRequest
from backend.engine.rollout import WorldModelEngine
from backend.engine.validation import GLOBAL_WINDOW
from backend.model.memory import commit_record_bytes
from bench.recache import EventRun, event_rollout, ground_truth
from factories import tiny_settings, tiny_request
from sp_workers import recache_event

SNOW = "it starts to snow"
BLOCK, TOKENS_PER_FRAME, WINDOW, SINK = 3, 16, 9, 3
AT, BLOCKS = 2, 4  # the event before block 2 of 4: 6 frames cached, none evicted yet


def request_of(blocks: int) -> SessionRequest:
    return tiny_request(num_frames=video_frames_for(blocks * BLOCK), decode=False)


def max_cache_distance(a: EventRun, b: EventRun) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a.keys + a.values, b.keys + b.values))


def assert_cache_matches(recached: EventRun, truth: EventRun, label: str) -> None:
    assert (recached.length, recached.evicted_tokens) == (truth.length, truth.evicted_tokens)
    distance = max_cache_distance(recached, truth)
    print(f"{label}: recached K/V vs teacher-forced ground truth, max abs diff {distance:.3g}")
    assert distance <= 1e-5


@pytest.fixture(scope="module")
def single(engine: WorldModelEngine) -> dict[str, EventRun]:
    request = request_of(BLOCKS)
    recached = event_rollout(engine, request, BLOCKS, AT, SNOW, recache=True)
    return {"recached": recached, "stale": event_rollout(engine, request, BLOCKS, AT, SNOW),
            "truth": ground_truth(engine, request, BLOCKS, AT, SNOW, recached)}


def test_a_recache_equals_the_teacher_forced_ground_truth(single: dict[str, EventRun]) -> None:
    recached, stale, truth = single["recached"], single["stale"], single["truth"]
    assert recached.length == AT * BLOCK * TOKENS_PER_FRAME and recached.evicted_tokens == 0
    assert recached.kept_blocks == AT
    assert_cache_matches(recached, truth, "SP1")
    # Without the recache the cache still holds the old prompt's K/V (past layer 0, which sees no text yet).
    print(f"SP1 without recache: max abs diff {max_cache_distance(stale, truth):.3g}")
    assert max_cache_distance(stale, truth) > 1e-3
    for index in range(AT, BLOCKS):  # what follows runs on the same cache
        assert np.abs(recached.latents[index] - truth.latents[index]).max() <= 1e-5


def test_a_session_without_the_flag_holds_nothing_and_keeping_changes_no_bit(engine: WorldModelEngine) -> None:
    request = request_of(5)
    runs = {}
    for keep in (False, True):
        with engine.session(request, keep_commits=keep) as session:
            runs[keep] = np.concatenate([out.latents.numpy() for out, _ in engine.blocks(session, decode=False)], 2)
            kept, kept_bytes = [r.first_frame for r in session.commits or ()], session.commit_bytes()
        assert session.commits in (None, [])  # closing the session drops its records
    assert np.array_equal(runs[False], runs[True])
    # After 5 blocks through the 9-frame window: block 0 (the sink), blocks 3 and 4; blocks 1 and 2 evicted.
    assert kept == [0, 9, 12]
    assert kept_bytes == 3 * commit_record_bytes(4, BLOCK, 8, 8)
    with engine.session(request) as session:
        engine.run_block([session])
        assert session.commits is None and session.commit_bytes() == 0
        with pytest.raises(InputError, match=r"opened without keep_commits"):
            engine.recache(session)


def test_global_attention_refuses_to_keep_commits_and_to_recache(engine: WorldModelEngine,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    request = request_of(2)
    with engine.session(request, keep_commits=True) as session:
        monkeypatch.setattr(engine, "window_frames", GLOBAL_WINDOW)
        with pytest.raises(InputError, match=r"recache \(keep_commits\) needs a sliding window: under "
                                             r"window_frames=-1 \(global attention\)"):
            engine.recache(session)
        with pytest.raises(InputError, match=r"window_frames=-1 \(global attention\)"):
            engine.open_session(request, engine.geometry_of(request), keep_commits=True)


def test_after_evictions_the_layout_stays_and_only_the_cached_frames_are_replayed(engine: WorldModelEngine) -> None:
    """Five blocks through the 9-frame window, then the event: the replay sees blocks 0, 3 and 4 only, so
    block 3 and 4's K/V differ from a full-history ground truth (which saw blocks 1 and 2); the sink does not."""
    blocks, at = 6, 5
    request = request_of(blocks)
    recached = event_rollout(engine, request, blocks, at, SNOW, recache=True)
    truth = ground_truth(engine, request, blocks, at, SNOW, recached)
    sink = SINK * TOKENS_PER_FRAME
    assert recached.length == truth.length == WINDOW * TOKENS_PER_FRAME
    assert recached.evicted_tokens == truth.evicted_tokens == (at * BLOCK - WINDOW) * TOKENS_PER_FRAME
    assert recached.kept_blocks == 3
    assert all(np.isfinite(x).all() for x in recached.keys + recached.values + recached.latents)
    sink_distance = max(float(np.abs(x[:, :sink] - y[:, :sink]).max())
                        for x, y in zip(recached.keys + recached.values, truth.keys + truth.values))
    assert sink_distance <= 1e-5
    after = np.abs(recached.latents[at] - truth.latents[at])
    print(f"after evictions: K/V vs the full-history ground truth, max abs diff {max_cache_distance(recached, truth):.3g}"
          f" (sink {sink_distance:.3g}); the next block's latents max {after.max():.3g}, mean {after.mean():.3g}")


def test_a_replay_of_partly_evicted_blocks_keeps_the_layout(tiny_checkpoint: str) -> None:
    """A 4-frame sink cuts block 1 (frame 3 in the sink, 4 and 5 evicted) and the window block 3 (frame 9
    evicted): the replay of blocks 0, 1, 3, 4 evicts those three frames again (recache checks it)."""
    engine = WorldModelEngine.load(tiny_settings(tiny_checkpoint, sink_frames=4))
    request = request_of(5)
    with engine.session(request, keep_commits=True) as session:
        for _ in engine.blocks(session, decode=False):
            pass
        assert [r.first_frame for r in session.commits] == [0, 3, 9, 12]
        engine.set_prompt(session, SNOW)
        engine.recache(session)
        assert session.cache.length == WINDOW * TOKENS_PER_FRAME
        assert session.cache.evicted_tokens == (5 * BLOCK - WINDOW) * TOKENS_PER_FRAME


# -- SP2 and TP2 x SP2: each rank's shards against the same group's ground truth; SP2 against SP1

LAYOUTS = [(1, 2), (2, 2)]  # (tp, sp)
HEADS = 4  # tiny preset


@pytest.fixture(scope="module")
def groups(tiny_checkpoint: str) -> dict[tuple[int, int], list[dict]]:
    from backend.parallel.local import run_group

    settings = tiny_settings(tiny_checkpoint, decode_frames=False)
    return {(tp, sp): run_group(tp * sp, recache_event, (dataclasses.replace(settings, tp_degree=tp, sp_degree=sp),
                                                          request_of(BLOCKS), SNOW, BLOCKS, AT))
            for tp, sp in LAYOUTS}


@pytest.mark.server
@pytest.mark.parametrize(("tp", "sp"), LAYOUTS)
def test_every_rank_recaches_its_shard_to_the_ground_truth(groups, tp: int, sp: int) -> None:
    for rank, result in enumerate(groups[tp, sp]):
        assert_cache_matches(result["recached"], result["truth"], f"TP{tp}xSP{sp} rank {rank}")


@pytest.mark.server
def test_an_sp2_recache_is_bit_identical_to_sp1(groups, single: dict[str, EventRun]) -> None:
    reference, local = single["recached"], HEADS // 2
    for rank, result in enumerate(groups[1, 2]):
        run = result["recached"]
        assert all(np.array_equal(a, b) for a, b in zip(run.latents[AT:], reference.latents[AT:])), rank
        for shard, full in zip(run.keys + run.values, reference.keys + reference.values):
            assert np.array_equal(shard, full[:, :, rank * local : (rank + 1) * local]), rank
