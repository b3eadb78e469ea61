"""Fast paths on one process (tiny checkpoint): kv_reuse skips each block's commit forward, keeps the K/V of its
last DMD step, is batched like the exact path, replays under a recache, and is a setting a replay must match.
SP1 == SP2 under kv_reuse: tests/test_engine_parallel.py."""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import numpy as np
import pytest

from backend.api.errors import InputError
from backend.api.provenance import parse_settings
from backend.engine.parts import EngineParts
from backend.engine.rollout import WorldModelEngine
from backend.engine.validation import checked_spec
from bench.recache import event_rollout
from factories import tiny_request

EXACT_SETTINGS = "block_frames=3;denoise_steps=4;dtype=float32;sink_frames=3;timestep_shift=5.0;window_frames=9"


@pytest.fixture(scope="module")
def reuse(engine: WorldModelEngine) -> WorldModelEngine:
    """The shared engine's models under kv_reuse."""
    spec = checked_spec(dataclasses.replace(engine.settings, kv_reuse=True), 1)
    return WorldModelEngine(spec, parts=EngineParts(engine.transformer, engine.prompts.encoder, engine.vae.vae))


@contextlib.contextmanager
def counted_forwards(engine: WorldModelEngine) -> Iterator[list[int]]:
    """A list that grows by one entry on every transformer forward while the block runs."""
    calls: list[int] = []
    handle = engine.transformer.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        yield calls
    finally:
        handle.remove()


def rollout(engine: WorldModelEngine, **request) -> tuple[np.ndarray, list[int]]:
    """A whole request's latents and the transformer forwards of each of its blocks."""
    latents, forwards = [], []
    with engine.session(tiny_request(decode=False, **request)) as session, counted_forwards(engine) as calls:
        for out, _ in engine.blocks(session, decode=False):
            latents.append(out.latents.numpy())
            forwards.append(len(calls) - sum(forwards))
    return np.concatenate(latents, axis=2), forwards


def test_kv_reuse_runs_4_forwards_a_block_where_the_exact_path_runs_5(
        engine: WorldModelEngine, reuse: WorldModelEngine) -> None:
    exact, exact_forwards = rollout(engine, num_frames=21)
    fast, fast_forwards = rollout(reuse, num_frames=21)
    assert exact_forwards == [5, 5] and engine.settings.forwards_per_block == 5
    assert fast_forwards == [4, 4] and reuse.settings.forwards_per_block == 4
    assert np.array_equal(fast[:, :, :3], exact[:, :, :3])  # the first block has no history to differ in
    assert np.abs(fast[:, :, 3:] - exact[:, :, 3:]).max() > 1e-3


def test_kv_reuse_batches_like_sessions_run_alone(reuse: WorldModelEngine) -> None:
    lengths = (21, 9)  # 2 blocks and 1: they share the first block's forwards
    alone = [rollout(reuse, num_frames=n, seed=s)[0] for s, n in enumerate(lengths)]
    requests = [tiny_request(num_frames=n, seed=s, decode=False) for s, n in enumerate(lengths)]
    sessions = [reuse.open_session(r, reuse.geometry_of(r)) for r in requests]
    batched: dict[str, list[np.ndarray]] = {s.id: [] for s in sessions}
    with counted_forwards(reuse) as calls:
        while running := [s for s in sessions if not s.done]:
            for out in reuse.run_block(running):
                batched[out.session_id].append(out.latents.numpy())
    assert len(calls) == 4 * max(s.num_blocks for s in sessions)  # one forward per step for the whole batch
    for session, expected in zip(sessions, alone):
        assert np.abs(np.concatenate(batched[session.id], axis=2) - expected).max() < 1e-5
        reuse.close_session(session)


def test_kv_reuse_is_in_settings_used_and_a_replay_on_the_other_value_is_refused(
        engine: WorldModelEngine, reuse: WorldModelEngine) -> None:
    assert parse_settings(reuse.settings_used)["kv_reuse"] == "True"
    assert parse_settings(engine.settings_used)["kv_reuse"] == "False"
    request = tiny_request(num_frames=9, decode=False)
    for server, recorded in ((reuse, engine.settings_used), (engine, reuse.settings_used)):
        with pytest.raises(InputError, match=rf"kv_reuse: expected {not server.settings.kv_reuse}, this server "
                                             rf"{server.settings.kv_reuse}") as refused:
            server.geometry_of(dataclasses.replace(request, expect_settings=recorded))
        assert refused.value.code == "SETTINGS_MISMATCH"
    # A recording made before the setting existed names no kv_reuse (nor decoder): it was made on the exact path.
    assert EXACT_SETTINGS == engine.settings_used.replace("kv_reuse=False;", "").replace("decoder=vae;", "")
    engine.geometry_of(dataclasses.replace(request, expect_settings=EXACT_SETTINGS))
    with pytest.raises(InputError, match="kv_reuse: expected False, this server True"):
        reuse.geometry_of(dataclasses.replace(request, expect_settings=EXACT_SETTINGS))


def test_a_recache_under_kv_reuse_replays_each_block_s_last_step(reuse: WorldModelEngine) -> None:
    """Before any eviction, a recache under the same prompt runs each kept block's last DMD step again (its
    noisy input at its timestep): the cache comes back bit for bit (a clean t = 0 replay would not)."""
    request = tiny_request(num_frames=33, decode=False)
    plain = event_rollout(reuse, request, blocks=3, at=2)
    recached = event_rollout(reuse, request, blocks=3, at=2, recache=True)
    assert recached.kept_blocks == 2 and recached.evicted_tokens == 0
    for a, b in zip(plain.keys + plain.values, recached.keys + recached.values):
        assert np.array_equal(a, b)
    assert np.array_equal(plain.latents[2], recached.latents[2])
    with pytest.raises(ValueError, match="kv_reuse runs none"):
        event_rollout(reuse, request, blocks=1, at=1, teacher=plain.latents[:1])


def test_the_fast_path_table_s_14b_block_costs() -> None:
    """bench.fastpaths' 14B columns: a full-window block of 4,680 tokens, 5 forwards on the exact path (the camera
    branch in the first alone: 5 x 261.3 less 4 x 39.8 TFLOP), 4 under kv_reuse (3 x 39.8 less)."""
    from backend.engine.settings import EngineSettings
    from backend.model.config import TransformerConfig
    from bench.fastpaths import EXACT, PATHS, full_window_cost

    cfg, base = TransformerConfig.lingbot_14b(), EngineSettings(checkpoint="(none)")
    costs = {p.name: full_window_cost(cfg, p.settings(base)) for p in PATHS}
    exact, reuse = costs[EXACT.name], costs["kv_reuse"]
    assert (exact.forwards, reuse.forwards) == (5, 4)
    assert exact.flop / 1e12 == pytest.approx(1147, abs=2) and reuse.flop / 1e12 == pytest.approx(926, abs=2)
    assert exact.cache_bytes == reuse.cache_bytes == 40 * 2 * 18 * 1560 * 5120 * 2  # 23 GB at SP1 in bf16
    assert costs["window 9, sink 3"].cache_bytes * 2 == exact.cache_bytes
    assert reuse.kv_read_bytes == 4 * exact.cache_bytes
