"""Camera features as the reference computes them: interpolation, relative and framewise poses, rays, fold."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from backend.engine.camera_track import CameraTrack
from backend.model import camera as cam


def rot_z(a: float) -> np.ndarray:
    c, s = math.cos(a), math.sin(a)
    return np.array([[c, -s, 0], [s, c, 0], [0, 0, 1]], dtype=np.float64)


def rot_x(a: float) -> np.ndarray:
    c, s = math.cos(a), math.sin(a)
    return np.array([[1, 0, 0], [0, c, -s], [0, s, c]], dtype=np.float64)


def pose(rotation: np.ndarray, t) -> np.ndarray:
    p = np.eye(4)
    p[:3, :3], p[:3, 3] = rotation, t
    return p


def test_identity_poses_give_zero_origins_and_pixel_directions() -> None:
    h, w = 16, 24
    k = torch.tensor([10.0, 12.0, 11.0, 7.0])
    rays = cam.plucker_rays(torch.eye(4).repeat(3, 1, 1), k, h, w)
    assert rays.shape == (3, 6, h, w) and torch.all(rays[:, :3] == 0)
    for y, x in [(0, 0), (5, 9), (h - 1, w - 1)]:
        d = np.array([(x + 0.5 - 11.0) / 10.0, (y + 0.5 - 7.0) / 12.0, 1.0])
        for f in range(3):
            np.testing.assert_allclose(rays[f, 3:, y, x].numpy(), d / np.linalg.norm(d), rtol=1e-6, atol=1e-7)


def test_pure_translation_gives_a_constant_origin() -> None:
    p = torch.eye(4).repeat(2, 1, 1)
    p[1, :3, 3] = torch.tensor([0.3, -0.2, 0.5])
    rays = cam.plucker_rays(p, torch.tensor([8.0, 8.0, 8.0, 4.0]), 8, 16)
    assert torch.all(rays[1, 0] == 0.3) and torch.all(rays[1, 1] == -0.2) and torch.all(rays[1, 2] == 0.5)
    torch.testing.assert_close(rays[1, 3:], rays[0, 3:])


def test_rotation_rotates_directions() -> None:
    k = torch.tensor([4.0, 4.0, 4.0, 4.0])
    rotation = torch.from_numpy(rot_x(0.4)).float()
    p = torch.eye(4)[None].clone()
    p[0, :3, :3] = rotation
    expected = (rotation @ cam.pixel_directions(k, 8, 8).T).reshape(3, 8, 8)
    torch.testing.assert_close(cam.plucker_rays(p, k, 8, 8)[0, 3:], expected)


def test_fold_matches_an_explicit_loop() -> None:
    x = torch.randn(2, 6, 16, 24, generator=torch.Generator().manual_seed(0))
    y = cam.fold_to_latent(x, 8)
    assert y.shape == (2, 384, 2, 3)
    expected = torch.empty_like(y)
    for f in range(2):
        for c in range(6):
            for p1 in range(8):
                for p2 in range(8):
                    for h in range(2):
                        for w in range(3):
                            expected[f, c * 64 + p1 * 8 + p2, h, w] = x[f, c, h * 8 + p1, w * 8 + p2]
    assert torch.equal(y, expected)


def test_framewise_deltas_and_normalisation_on_a_hand_built_trajectory() -> None:
    c0 = pose(rot_z(math.pi / 2), [1, 0, 0])
    c1 = c0 @ pose(np.eye(3), [2, 0, 0])  # 2 along the camera's x
    c2 = c1 @ pose(rot_z(0.3), [0, 1, 0])  # 1 along the camera's y, then a yaw
    p = torch.tensor(np.stack([c0, c1, c2]), dtype=torch.float32)
    relative = cam.relative_to_first(p)
    assert torch.equal(relative[0], torch.eye(4))
    d = cam.framewise_deltas(relative)
    close = dict(atol=1e-6, rtol=0)
    torch.testing.assert_close(d[1], torch.tensor(pose(np.eye(3), [2, 0, 0]), dtype=torch.float32), **close)
    torch.testing.assert_close(d[2], torch.tensor(pose(rot_z(0.3), [0, 1, 0]), dtype=torch.float32), **close)
    scale = cam.translation_scale(d)
    assert scale == pytest.approx(2.0, abs=1e-6)
    n = cam.normalise_translations(d, scale)
    torch.testing.assert_close(n[1, :3, 3], torch.tensor([1.0, 0, 0]), **close)
    torch.testing.assert_close(n[2, :3, 3], torch.tensor([0, 0.5, 0]), **close)
    torch.testing.assert_close(n[:, :3, :3], d[:, :3, :3])
    torch.testing.assert_close(cam.normalise_translations(d, 4.0)[1, :3, 3], torch.tensor([0.5, 0, 0]), **close)
    assert torch.equal(cam.normalise_translations(d, 0.0), d)


def test_81_frames_interpolate_to_every_4th_pose() -> None:
    rng = np.random.default_rng(0)
    poses = np.stack([pose(rot_z(0.01 * i) @ rot_x(0.005 * i), rng.normal(size=3)) for i in range(81)])
    out = cam.interpolate_poses(poses, 21)
    assert out.dtype == torch.float32
    np.testing.assert_allclose(out.numpy(), poses[::4].astype(np.float32), atol=1e-6)


def test_interpolation_at_non_integer_positions() -> None:
    p0 = pose(rot_z(0.0), [0, 0, 0])
    p1 = pose(rot_z(1.0), [2, 4, 6])
    p2 = pose(rot_z(1.0) @ rot_x(0.8), [2, 4, 10])
    out = cam.interpolate_poses(np.stack([p0, p1, p2]), 5)  # positions 0, .5, 1, 1.5, 2
    np.testing.assert_allclose(out[1, :3, :3].numpy(), rot_z(0.5), atol=1e-6)
    np.testing.assert_allclose(out[1, :3, 3].numpy(), [1, 2, 3], atol=1e-6)
    np.testing.assert_allclose(out[3, :3, :3].numpy(), rot_z(1.0) @ rot_x(0.4), atol=1e-6)
    np.testing.assert_allclose(out[3, :3, 3].numpy(), [2, 4, 8], atol=1e-6)
    # The shortest arc: halfway to a 350 degree turn is -5 degrees, not 175.
    out = cam.interpolate_poses(np.stack([pose(rot_z(0), [0, 0, 0]), pose(rot_z(math.radians(350)), [0, 0, 0])]), 3)
    np.testing.assert_allclose(out[1, :3, :3].numpy(), rot_z(math.radians(-5)), atol=1e-6)


def rot_y(a: float) -> np.ndarray:
    c, s = math.cos(a), math.sin(a)
    return np.array([[c, 0, s], [0, 1, 0], [-s, 0, c]], dtype=np.float64)


@pytest.mark.parametrize("axis", [rot_x, rot_y, rot_z], ids=["pitch", "yaw", "roll"])
def test_a_camera_that_turns_all_the_way_round_interpolates_on_its_own_arc(axis) -> None:
    """A turn of 5 degrees a frame, 73 frames (a full circle), about one axis: past 90 degrees the quaternion is
    read from that axis's diagonal entry, not the trace. Every 4th pose comes back, and each midpoint is the turn
    halfway (2.5 degrees on), whichever branch read it."""
    step = math.radians(5)
    poses = np.stack([pose(axis(step * i) @ rot_x(0.01), [0.0, 0.1 * i, 0.0]) for i in range(73)])
    every_4th = cam.interpolate_poses(poses, 19).numpy()
    np.testing.assert_allclose(every_4th, poses[::4].astype(np.float32), atol=2e-6)
    halves = cam.interpolate_poses(poses, 145).numpy()[1::2]
    want = np.stack([pose(axis(step * (i + 0.5)) @ rot_x(0.01), [0.0, 0.1 * (i + 0.5), 0.0]) for i in range(72)])
    np.testing.assert_allclose(halves, want.astype(np.float32), atol=2e-6)


def test_camera_features_shape_and_first_frame_at_origin() -> None:
    c2w = np.stack([pose(rot_z(0.02 * i), [0.1 * i, 0, 0]) for i in range(9)]).astype(np.float32)
    poses = CameraTrack.whole(c2w, np.array([20, 20, 16, 8], np.float32), 3).next_block(c2w)
    assert torch.equal(poses[0], torch.eye(4))
    assert cam.translation_scale(poses) == pytest.approx(1.0)
    features = cam.camera_features(poses, torch.tensor([20.0, 20.0, 16.0, 8.0]), 16, 32, 8)
    assert features.shape == (384, 3, 2, 4) and features.dtype == torch.float32
    assert torch.all(features[:3 * 64, 0] == 0)  # the first camera's origin
