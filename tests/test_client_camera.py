"""Camera presets, intrinsics and action-directory loading (client/camera.py, client/action.py)."""
from __future__ import annotations

from pathlib import Path

import imageio.v3 as iio
import numpy as np
import pytest
import torch

from client.action import ActionDirError, load_action_dir
from backend.api.request import default_intrinsics
from client.camera import PRESETS, camera_preset, scale_intrinsics

N = 17


@pytest.mark.parametrize("name", PRESETS)
def test_preset_shapes_and_rigid_motion(name: str) -> None:
    poses = camera_preset(name, N)
    assert poses.shape == (N, 4, 4) and poses.dtype == np.float32
    np.testing.assert_allclose(poses[0], np.eye(4), atol=1e-6)
    np.testing.assert_allclose(poses[:, 3], np.tile([0, 0, 0, 1], (N, 1)), atol=1e-6)
    rot = poses[:, :3, :3].astype(np.float64)
    np.testing.assert_allclose(rot @ rot.transpose(0, 2, 1), np.tile(np.eye(3), (N, 1, 1)), atol=1e-5)
    np.testing.assert_allclose(np.linalg.det(rot), 1.0, atol=1e-5)


def _final(name: str) -> tuple[np.ndarray, np.ndarray]:
    """(position, viewing direction) of the last camera in world coordinates."""
    pose = camera_preset(name, N)[-1]
    return pose[:3, 3], pose[:3, 2]


def test_translation_presets_move_along_camera_axes() -> None:
    for name, axis, sign in [("forward", 2, 1), ("backward", 2, -1), ("strafe_right", 0, 1), ("strafe_left", 0, -1)]:
        position, view = _final(name)
        assert sign * position[axis] > 0.1, name
        assert abs(position[[i for i in range(3) if i != axis]]).max() < 1e-6, name
        np.testing.assert_allclose(view, [0, 0, 1], atol=1e-6)


def test_forward_motion_is_monotonic_plus_z() -> None:
    z = camera_preset("forward", N)[:, 2, 3]
    assert np.all(np.diff(z) > 0)


def test_turn_presets_rotate_in_place_towards_their_side() -> None:
    for name, sign in [("right", 1), ("left", -1)]:
        position, view = _final(name)
        np.testing.assert_allclose(position, 0, atol=1e-6)
        assert sign * view[0] > 0.1 and abs(view[1]) < 1e-6, name  # x right, y down: no pitch


def test_orbit_keeps_looking_at_the_point_ahead() -> None:
    poses = camera_preset("orbit", N, orbit_radius=2.0, yaw_deg=3.0)
    target = np.array([0.0, 0.0, 2.0])
    to_target = target - poses[:, :3, 3]
    to_target /= np.linalg.norm(to_target, axis=1, keepdims=True)
    np.testing.assert_allclose(to_target, poses[:, :3, 2], atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(poses[:, :3, 3] - target, axis=1), 2.0, atol=1e-5)


def test_static_and_unknown_presets() -> None:
    np.testing.assert_array_equal(camera_preset("static", N), np.tile(np.eye(4, dtype=np.float32), (N, 1, 1)))
    with pytest.raises(ValueError, match="unknown camera preset 'up'.*forward"):
        camera_preset("up", N)


def test_default_intrinsics_from_fov() -> None:
    k = default_intrinsics(N, 480, 832, hfov_deg=90.0)
    assert k.shape == (N, 4) and k.dtype == np.float32
    np.testing.assert_allclose(k[0], [416.0, 416.0, 416.0, 240.0], rtol=1e-6)  # tan(45) = 1
    assert default_intrinsics(1, 480, 832)[0, 0] == pytest.approx(416.0 / np.tan(np.pi / 6))


def reference_ks_transformed(ks: np.ndarray, height: int, width: int) -> np.ndarray:
    """The reference's get_Ks_transformed(Ks, 480, 832, height, width, height, width) on a float32 tensor."""
    k = torch.from_numpy(ks).float()
    fx, fy, cx, cy = k.chunk(4, dim=-1)
    sx, sy = width / 832, height / 480
    crop_x, crop_y = (width - width) / 2, (height - height) / 2
    return torch.cat([fx * sx, fy * sy, cx * sx - crop_x, cy * sy - crop_y], dim=-1).numpy()


def test_scale_intrinsics() -> None:
    scaled = scale_intrinsics(np.array([[1000.0, 900.0, 960.0, 540.0]]), (1080, 1920), (480, 832))
    np.testing.assert_allclose(scaled[0], [1000 * 832 / 1920, 900 * 480 / 1080, 416, 240], rtol=1e-6)


# An official example's intrinsics: given for 480x832 (cx about 416, cy about 240), whatever the image's size.
OFFICIAL_KS = np.array([481.33, 479.87, 415.73, 239.41], dtype=np.float32)


def _write_action_dir(root: Path, frames: int = 20, image_hw: tuple[int, int] = (720, 1280)) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    iio.imwrite(root / "image.jpg", np.full((*image_hw, 3), 128, dtype=np.uint8))
    poses = np.tile(np.eye(4), (frames, 1, 1))
    poses[:, 2, 3] = np.arange(frames)
    np.save(root / "poses.npy", poses)
    np.save(root / "intrinsics.npy", OFFICIAL_KS[None] + np.arange(frames, dtype=np.float32)[:, None] * 0.01)
    return root


@pytest.mark.parametrize("height, width", [(64, 64), (480, 832), (720, 1280), (128, 224)])
def test_action_dir_scales_intrinsics_from_480x832_not_from_the_image(tmp_path: Path, height, width) -> None:
    root = _write_action_dir(tmp_path / "a")  # a 1280x720 image, as the official examples are
    action = load_action_dir(root, num_frames=17, height=height, width=width)
    assert action.image.shape == (720, 1280, 3)
    assert action.poses.shape == (17, 4, 4) and action.poses.dtype == np.float32
    np.testing.assert_array_equal(action.poses[:, 2, 3], np.arange(17))
    assert action.intrinsics.shape == (17, 4) and action.intrinsics.dtype == np.float32
    expected = reference_ks_transformed(np.load(root / "intrinsics.npy")[:17], height, width)
    np.testing.assert_array_equal(action.intrinsics, expected)  # bit for bit, float32 as the reference
    # the principal point stays at the centre of the output frame
    np.testing.assert_allclose(action.intrinsics[0, 2:], [width / 2, height / 2], rtol=5e-3)


def test_action_dir_accepts_png(tmp_path: Path) -> None:
    root = _write_action_dir(tmp_path / "a", image_hw=(240, 416))
    (root / "image.jpg").unlink()
    iio.imwrite(root / "image.png", np.zeros((240, 416, 4), dtype=np.uint8))  # RGBA: alpha is dropped
    action = load_action_dir(root, num_frames=5, height=480, width=832)
    assert action.image.shape == (240, 416, 3)
    np.testing.assert_array_equal(action.intrinsics[0], OFFICIAL_KS)  # 480x832 asked: unchanged


@pytest.mark.parametrize(
    ("breakage", "message"),
    [
        (lambda d: (d / "poses.npy").unlink(), "missing poses.npy"),
        (lambda d: (d / "intrinsics.npy").unlink(), "missing intrinsics.npy"),
        (lambda d: (d / "image.jpg").unlink(), "missing first-frame image"),
        (lambda d: np.save(d / "poses.npy", np.zeros((20, 3, 4))), r"poses.npy has shape \[20, 3, 4\]; expected \[N, 4, 4\]"),
        (lambda d: np.save(d / "intrinsics.npy", np.zeros((20, 3, 3))), r"expected \[N, 4\]"),
        (lambda d: np.save(d / "poses.npy", np.tile(np.eye(4), (10, 1, 1))), "has 10 frames but 17 were requested"),
        (lambda d: np.save(d / "poses.npy", np.full((20, 4, 4), np.nan)), "finite numbers"),
    ],
)
def test_bad_action_dirs_say_what_is_wrong(tmp_path: Path, breakage, message: str) -> None:
    root = _write_action_dir(tmp_path / "a")
    breakage(root)
    with pytest.raises(ActionDirError, match=message):
        load_action_dir(root, num_frames=17, height=480, width=832)


def test_missing_action_dir(tmp_path: Path) -> None:
    with pytest.raises(ActionDirError, match="action directory not found"):
        load_action_dir(tmp_path / "nope", num_frames=17, height=480, width=832)
