"""Single-process rollout: determinism, conditioning, batching and causal per-block decoding."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from backend.engine.rollout import WorldModelEngine
from factories import forward_poses, tiny_config, tiny_request


def latents_of(engine: WorldModelEngine, num_frames: int = 21, **overrides) -> np.ndarray:
    request = tiny_request(num_frames=num_frames, **overrides)
    return np.concatenate([out.latents.numpy() for out, _ in engine.generate(request)], axis=2)


def test_same_seed_same_everything(engine: WorldModelEngine) -> None:
    first = engine.generate(tiny_request())
    second = engine.generate(tiny_request())
    assert len(first) == 5
    for (a, frames_a), (b, frames_b) in zip(first, second):
        assert torch.equal(a.latents, b.latents)
        assert np.array_equal(frames_a, frames_b)


@pytest.mark.parametrize(
    "overrides",
    [
        {"seed": 7},
        {"prompt": "a car on a road at night"},
        {"poses": forward_poses(21, step=-0.2)},
        {"image": np.full((64, 64, 3), 200, np.uint8)},
    ],
    ids=["seed", "prompt", "camera", "image"],
)
def test_every_condition_changes_the_output(engine: WorldModelEngine, overrides: dict) -> None:
    assert not np.allclose(latents_of(engine), latents_of(engine, **overrides), atol=1e-4)


def test_frame_counts_and_dtype(engine: WorldModelEngine) -> None:
    results = engine.generate(tiny_request(num_frames=21))
    assert [frames.shape for _, frames in results] == [(9, 64, 64, 3), (12, 64, 64, 3)]
    assert all(frames.dtype == np.uint8 for _, frames in results)
    assert [out.block_index for out, _ in results] == [0, 1]


def test_streamed_decode_equals_whole_clip_decode(engine: WorldModelEngine) -> None:
    results = engine.generate(tiny_request(num_frames=33))
    streamed = np.concatenate([frames for _, frames in results])
    latents = torch.cat([out.latents for out, _ in results], dim=2)
    vae = engine.vae
    with torch.no_grad():
        whole = vae.vae.decode(latents / vae.inv_std + vae.mean).sample.clamp(-1, 1)[0]
    whole = ((whole + 1.0) * 127.5).round().to(torch.uint8).permute(1, 2, 3, 0).numpy()
    assert streamed.shape == whole.shape == (33, 64, 64, 3)
    assert np.array_equal(streamed, whole)


def test_batched_sessions_match_sessions_run_alone(engine: WorldModelEngine) -> None:
    lengths = (33, 21)  # clips of different lengths share forwards while both have blocks left
    requests = [tiny_request(num_frames=n, seed=s) for s, n in enumerate(lengths)]
    alone = [latents_of(engine, num_frames=n, seed=s) for s, n in enumerate(lengths)]
    sessions = [engine.open_session(r, engine.geometry_of(r)) for r in requests]
    batched: dict[str, list[np.ndarray]] = {s.id: [] for s in sessions}
    while running := [s for s in sessions if not s.done]:
        for out in engine.run_block(running):
            batched[out.session_id].append(out.latents.numpy())
    for session, expected in zip(sessions, alone):
        diff = np.abs(np.concatenate(batched[session.id], axis=2) - expected).max()
        assert diff < 1e-5, f"{session.id}: batched vs alone max abs diff {diff}"


def test_resized_image_and_no_decode(engine: WorldModelEngine) -> None:
    request = tiny_request(num_frames=9, image=np.zeros((100, 37, 3), np.uint8), decode=False)
    ((out, frames),) = engine.generate(request)
    assert frames.shape == (0, 64, 64, 3)
    assert out.latents.shape == (1, 4, 3, 8, 8)


def test_close_session_frees_caches(engine: WorldModelEngine) -> None:
    request = tiny_request(num_frames=9)
    session = engine.open_session(request, engine.geometry_of(request))
    assert session.cache_bytes() > 0
    engine.close_session(session)
    assert session.cache_bytes() == 0


def test_config_from_triton_parameters(tiny_checkpoint: str) -> None:
    from backend.api.settings import from_parameters
    from backend.engine.config import EngineConfig
    from backend.api.errors import ConfigError

    config = from_parameters(EngineConfig, {"checkpoint": tiny_checkpoint, "sp_degree": "2", "decode_frames": "false"})
    assert dataclasses.astuple(config)[:2] == (tiny_checkpoint, 2) and config.decode_frames is False
    with pytest.raises(ConfigError, match=r"unknown EngineConfig parameter\(s\) \['sp'\]"):
        from_parameters(EngineConfig, {"checkpoint": tiny_checkpoint, "sp": "2"})
    with pytest.raises(ConfigError, match=r"parameter sp_degree='two': expected int"):
        from_parameters(EngineConfig, {"checkpoint": tiny_checkpoint, "sp_degree": "two"})


def test_compiled_blocks_stay_close_to_eager(tiny_checkpoint: str, engine: WorldModelEngine) -> None:
    request = tiny_request(num_frames=21)  # two blocks: the first (no history) and one that attends to it
    compiled = WorldModelEngine.load(tiny_config(tiny_checkpoint, compile=True))
    for (eager_out, eager_frames), (out, frames) in zip(engine.generate(request), compiled.generate(request)):
        assert np.abs(out.latents.numpy() - eager_out.latents.numpy()).max() < 1e-4
        assert np.abs(frames.astype(int) - eager_frames.astype(int)).max() <= 2


def test_an_open_ended_session_keeps_constant_memory(engine: WorldModelEngine) -> None:
    """A steered session 10x the window long: the KV window rolls, its bytes never grow, the condition
    encoder reaches its fixed point and frees its cache."""
    from backend.api.request import Controls
    from backend.engine.blocks import BlockControls

    request = dataclasses.replace(tiny_request(num_frames=9, decode=False), num_frames=None, poses=None, keys="w")
    window_blocks = engine.window_frames // engine.config.block_frames
    with engine.session(request) as session:
        sizes = []
        for _ in range(10 * window_blocks):
            engine.run_block([session], {session.id: BlockControls(Controls(keys="w"))})
            sizes.append(session.cache_bytes())
        assert not session.done and session.block_index == 10 * window_blocks
        assert len(set(sizes)) == 1  # allocated once for the window, whatever the length
        assert session.cache.length == session.cache.capacity and session.cache.evicted_tokens > 0
        assert session.condition.steady is not None and session.condition.feature_cache is None
