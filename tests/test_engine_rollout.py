"""Single-process rollout: determinism, conditioning, batching and causal per-block decoding."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from backend.engine.rollout import WorldModelEngine
from factories import forward_poses, sample_image, tiny_settings, tiny_request


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


def turning_from_block_1(num_frames: int = 21) -> np.ndarray:
    """forward_poses, turning left (yaw) from video frame 9 on: block 0's 9 frames keep their poses."""
    poses = forward_poses(num_frames)
    angle = np.radians(20.0) * np.clip(np.arange(num_frames) - 8, 0, None) / num_frames
    poses[:, 0, 0], poses[:, 0, 2], poses[:, 2, 0], poses[:, 2, 2] = (np.cos(angle), np.sin(angle), -np.sin(angle),
                                                                      np.cos(angle))
    return poses


@pytest.mark.parametrize(
    ("overrides", "same_blocks"),
    [
        ({"seed": 7}, 0),  # the noise of every block
        ({"prompt": "a car on a road at night"}, 0),  # the cross-attention of every block
        ({"image": np.full((64, 64, 3), 200, np.uint8)}, 0),  # the first frame conditions every block
        ({"poses": turning_from_block_1(), "pose_scale": "running"}, 1),  # the blocks from the change on
    ],
    ids=["seed", "prompt", "image", "camera"],
)
def test_each_condition_changes_the_blocks_it_conditions(engine: WorldModelEngine, overrides: dict,
                                                         same_blocks: int) -> None:
    """Each input moves the latents of the blocks it conditions beyond float rounding, and leaves the blocks before
    it bit for bit (a camera that turns from block 1 on leaves block 0; the running scale, so the clip's largest
    translation does not reach back)."""
    base = {"pose_scale": "running"} if "pose_scale" in overrides else {}
    before, after = latents_of(engine, **base), latents_of(engine, **overrides)
    blocks = before.shape[2] // engine.settings.block_frames
    moved = [float(np.abs(a - b).max()) for a, b in zip(np.split(before, blocks, 2), np.split(after, blocks, 2))]
    assert moved[:same_blocks] == [0.0] * same_blocks and min(moved[same_blocks:]) > 1e-2, moved


def test_num_frames_sets_how_many_blocks_of_the_same_world(engine: WorldModelEngine) -> None:
    """9 + 12 k frames make 1 + k blocks (9 video frames, then 12 each); a longer clip on the same camera path
    (the running scale) is the shorter one's blocks, bit for bit, and more."""
    runs = {n: engine.generate(tiny_request(num_frames=n, poses=forward_poses(n), pose_scale="running"))
            for n in (9, 21, 33)}
    for n, results in runs.items():
        assert [frames.shape for _, frames in results] == [(9, 64, 64, 3)] + [(12, 64, 64, 3)] * ((n - 9) // 12)
        assert [out.block_index for out, _ in results] == list(range(len(results)))
        assert all(frames.dtype == np.uint8 for _, frames in results)
    for short, long in ((9, 21), (21, 33)):
        for (a, frames_a), (b, frames_b) in zip(runs[short], runs[long]):
            assert torch.equal(a.latents, b.latents) and np.array_equal(frames_a, frames_b)


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


def test_a_picture_of_any_size_is_resized_and_decode_changes_only_the_frames(engine: WorldModelEngine) -> None:
    """The first frame is resized to height x width: the same uniform picture at 100 x 37 and at 64 x 64 gives the
    same latents (to float rounding), a different 100 x 37 picture other ones; without decode the latents stay
    bit for bit and no frames come."""
    uniform = [latents_of(engine, 9, image=np.full(shape, 90, np.uint8)) for shape in ((100, 37, 3), (64, 64, 3))]
    assert np.abs(uniform[0] - uniform[1]).max() < 1e-5
    assert np.abs(uniform[0] - latents_of(engine, 9, image=sample_image(100)[:, :37])).max() > 1e-2
    request = tiny_request(num_frames=9, image=np.full((100, 37, 3), 90, np.uint8))
    ((out, frames),) = engine.generate(request)
    ((bare, no_frames),) = engine.generate(dataclasses.replace(request, decode=False))
    assert frames.shape == (9, 64, 64, 3) and no_frames.shape == (0, 64, 64, 3)
    assert torch.equal(out.latents, bare.latents) and out.latents.shape == (1, 4, 3, 8, 8)


def test_close_session_frees_caches(engine: WorldModelEngine) -> None:
    request = tiny_request(num_frames=9)
    session = engine.open_session(request, engine.geometry_of(request))
    assert session.cache_bytes() > 0
    engine.close_session(session)
    assert session.cache_bytes() == 0


def test_settings_from_triton_parameters(tiny_checkpoint: str) -> None:
    from backend.api.settings import from_parameters
    from backend.engine.settings import EngineSettings
    from backend.api.errors import ConfigError

    settings = from_parameters(EngineSettings,
                               {"checkpoint": tiny_checkpoint, "sp_degree": "2", "decode_frames": "false"})
    assert dataclasses.astuple(settings)[:2] == (tiny_checkpoint, 2) and settings.decode_frames is False
    with pytest.raises(ConfigError, match=r"unknown EngineSettings parameter\(s\) \['sp'\]"):
        from_parameters(EngineSettings, {"checkpoint": tiny_checkpoint, "sp": "2"})
    with pytest.raises(ConfigError, match=r"parameter sp_degree='two': expected int"):
        from_parameters(EngineSettings, {"checkpoint": tiny_checkpoint, "sp_degree": "two"})


@pytest.mark.slow  # inductor's C++ build; test_model_transformer compiles the blocks with a counting backend
def test_compiled_blocks_stay_close_to_eager(tiny_checkpoint: str, engine: WorldModelEngine) -> None:
    request = tiny_request(num_frames=21)  # two blocks: the first (no history) and one that attends to it
    compiled = WorldModelEngine.load(tiny_settings(tiny_checkpoint, compile=True))
    for (eager_out, eager_frames), (out, frames) in zip(engine.generate(request), compiled.generate(request)):
        assert np.abs(out.latents.numpy() - eager_out.latents.numpy()).max() < 1e-4
        assert np.abs(frames.astype(int) - eager_frames.astype(int)).max() <= 2


def test_an_open_ended_session_keeps_constant_memory(engine: WorldModelEngine) -> None:
    """A steered session 10x the window long: the KV window rolls, its bytes never grow, the condition
    encoder reaches its fixed point and frees its cache."""
    from backend.api.request import Controls
    from backend.engine.blocks import BlockControls

    request = dataclasses.replace(tiny_request(num_frames=9, decode=False), num_frames=None, poses=None, keys="w")
    window_blocks = engine.window_frames // engine.settings.block_frames
    with engine.session(request) as session:
        sizes = []
        for _ in range(10 * window_blocks):
            engine.run_block([session], {session.id: BlockControls(Controls(keys="w"))})
            sizes.append(session.cache_bytes())
        assert not session.done and session.block_index == 10 * window_blocks
        assert len(set(sizes)) == 1  # allocated once for the window, whatever the length
        assert session.cache.length == session.cache.capacity and session.cache.evicted_tokens > 0
        assert session.condition.steady is not None and session.condition.feature_cache is None


def test_a_block_reports_its_compute_time_in_milliseconds(engine: WorldModelEngine) -> None:
    """dit_ms (the response's timing_ms[0]) is the block's own wall time: within what the caller measured around it,
    and most of it."""
    import time

    with engine.session(tiny_request(num_frames=9, decode=False)) as session:
        began = time.perf_counter()
        (out,) = engine.run_block([session])
        wall_ms = (time.perf_counter() - began) * 1000.0
    assert 0.5 * wall_ms <= out.dit_ms <= wall_ms
