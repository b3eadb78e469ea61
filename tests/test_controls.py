"""Held keys -> poses (the integrator the server and the clients share) and a session's camera track."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from backend.api.contract import BLOCK_FRAMES
from backend.api.controls import MOVE_PER_FRAME, TURN_PER_FRAME_DEG, integrate, parse_key_script, parse_keys, \
    parse_play_script
from backend.api.errors import InputError
from backend.api.request import Controls
from backend.engine.camera_track import CameraTrack, split_blocks
from backend.model import camera as cam


def test_keys_are_normalised_and_unknown_keys_named() -> None:
    assert parse_keys("WA") == "aw" and parse_keys("-") == "" and parse_keys("ww") == "w"
    with pytest.raises(InputError, match=r"unknown key\(s\) \['q', 'x'\]"):
        parse_keys("wqx")
    assert parse_key_script("w*2,wa,-*2") == ["w", "w", "aw", "", ""]
    with pytest.raises(InputError, match=r"'w\*two'"):
        parse_key_script("w*two")


def test_a_play_script_carries_world_events_on_the_next_block() -> None:
    assert parse_play_script("w*2,@it starts to snow,d*2, @! rain ,-") == [
        Controls(keys="w"), Controls(keys="w"), Controls(keys="d", prompt="it starts to snow"), Controls(keys="d"),
        Controls(keys="", prompt="rain", recache=True)]  # "@!": the cached frames recomputed under it
    for script, error in [("@snow,w", r"before the first block"), ("w,@snow", r"no block after it"),
                          ("w,@a,@b,w", r"two prompt events in a row"), ("w,@ ,w", r"empty prompt event"),
                          ("w,@!,w", r"empty prompt event '@!'")]:
        with pytest.raises(InputError, match=error):
            parse_play_script(script)
    with pytest.raises(InputError, match=r"prompt event '@snow' where only keys are taken"):
        parse_key_script("w,@snow,w")


def after(keys: str, frames: int = 10) -> np.ndarray:
    return integrate(np.eye(4), keys, frames)[-1].astype(np.float64)


STEP, TURN = 10 * MOVE_PER_FRAME, math.radians(10 * TURN_PER_FRAME_DEG)
# Each key alone for 10 frames, OpenCV axes (x right, y down, z forward): where the camera went, and where it looks.
KEY_MOTIONS = {
    "w": ([0, 0, STEP], [0, 0, 1]), "s": ([0, 0, -STEP], [0, 0, 1]),
    "d": ([STEP, 0, 0], [0, 0, 1]), "a": ([-STEP, 0, 0], [0, 0, 1]),
    "l": ([0, 0, 0], [math.sin(TURN), 0, math.cos(TURN)]), "j": ([0, 0, 0], [-math.sin(TURN), 0, math.cos(TURN)]),
    "i": ([0, 0, 0], [0, -math.sin(TURN), math.cos(TURN)]), "k": ([0, 0, 0], [0, math.sin(TURN), math.cos(TURN)]),
}


@pytest.mark.parametrize("key", KEY_MOTIONS)
def test_each_key_moves_the_camera_its_own_way(key: str) -> None:
    """W/S forward/back, D/A right/left, L/J turn right/left, I/K look up/down: each key alone, its sign included."""
    moved, looks = KEY_MOTIONS[key]
    pose = after(key)
    np.testing.assert_allclose(pose[:3, 3], moved, atol=1e-6)
    np.testing.assert_allclose(pose[:3, :3] @ np.array([0, 0, 1.0]), looks, atol=1e-6)


@pytest.mark.parametrize("pair", ["ws", "ad", "jl", "ik"])
def test_opposite_keys_held_together_cancel(pair: str) -> None:
    np.testing.assert_allclose(after(pair), np.eye(4), atol=1e-6)


def test_held_keys_move_relative_to_the_current_heading() -> None:
    """W after a quarter turn right goes where the camera looks (+x), and keys combine ("wl")."""
    start = integrate(np.eye(4), "l", 90)[-1]
    np.testing.assert_allclose(integrate(start, "w", 1)[0][:3, 3] - start[:3, 3], [MOVE_PER_FRAME, 0, 0], atol=1e-6)
    both = after("wl", 1)
    np.testing.assert_allclose(both[:3, 3], [0, 0, MOVE_PER_FRAME], atol=1e-6)
    np.testing.assert_allclose(both[:3, :3], after("l", 1)[:3, :3], atol=1e-6)


def trajectory(frames: int) -> np.ndarray:
    poses = []
    for i in range(frames):
        a, b = 0.02 * i, 0.01 * i
        rotation = np.array([[math.cos(a), 0, math.sin(a)], [0, 1, 0], [-math.sin(a), 0, math.cos(a)]]) @ np.array(
            [[1, 0, 0], [0, math.cos(b), -math.sin(b)], [0, math.sin(b), math.cos(b)]])
        p = np.eye(4)
        p[:3, :3], p[:3, 3] = rotation, [0.1 * i, 0.02 * i * i / frames, 0.3 * i]
        poses.append(p)
    return np.stack(poses).astype(np.float32)


@pytest.mark.parametrize(("block_frames", "frames"), [(BLOCK_FRAMES, 81), (4, 77)])
def test_block_by_block_track_equals_the_reference_whole_clip_pipeline(block_frames: int, frames: int) -> None:
    poses = trajectory(frames)
    reference = cam.framewise_deltas(cam.relative_to_first(cam.interpolate_poses(poses, 1 + (frames - 1) // 4)))
    reference = cam.normalise_translations(reference, cam.translation_scale(reference))
    track = CameraTrack.whole(poses, np.array([50, 50, 32, 32], np.float32), block_frames)
    blocks = split_blocks(poses, block_frames)
    assert [len(b) for b in blocks[:2]] == [1 + 4 * (block_frames - 1), 4 * block_frames]
    assert torch.equal(torch.cat([track.next_block(block) for block in blocks]), reference)


def test_a_steered_track_divides_by_the_running_maximum() -> None:
    poses = trajectory(33)
    track = CameraTrack(np.array([50, 50, 32, 32], np.float32), BLOCK_FRAMES)
    first = track.next_block(poses[:9])
    scale_after_first = track.running_scale
    track.next_block(poses[9:21])
    assert track.running_scale >= scale_after_first > 0
    assert float(first[1:, :3, 3].norm(dim=-1).max()) == pytest.approx(1.0)  # the running maximum so far is 1


def test_a_held_block_repeats_the_last_frame_motion() -> None:
    track = CameraTrack(np.array([50, 50, 32, 32], np.float32), BLOCK_FRAMES)
    track.next_block(integrate(np.eye(4), "w", 9))
    held = track.resolve(None)
    assert held.shape == (12, 4, 4)
    np.testing.assert_allclose(np.diff(held[:, 2, 3]), MOVE_PER_FRAME, atol=1e-5)
