"""Camera scripts: preset trajectories and intrinsics rescaling (numpy only).

Poses are camera-to-world 4x4 matrices in OpenCV axes (x right, y down, z forward),
starting at the identity; intrinsics are rows of fx, fy, cx, cy in pixels.
"""
from __future__ import annotations

import numpy as np

PRESETS = ("forward", "backward", "left", "right", "strafe_left", "strafe_right", "orbit", "static")

DEFAULT_STEP = 0.05  # translation per frame, in scene units (about 4 units over 81 frames)
DEFAULT_YAW_DEG = 1.0  # rotation per frame for turning and orbiting (80 degrees over 81 frames)
DEFAULT_ORBIT_RADIUS = 2.0  # distance to the orbited point straight ahead of the first camera


def _rot_y(angle_rad: np.ndarray) -> np.ndarray:
    """[N, 3, 3] rotations about the camera's y (down) axis; positive angles turn right."""
    c, s = np.cos(angle_rad), np.sin(angle_rad)
    rot = np.zeros((len(angle_rad), 3, 3))
    rot[:, 0, 0], rot[:, 0, 2] = c, s
    rot[:, 1, 1] = 1.0
    rot[:, 2, 0], rot[:, 2, 2] = -s, c
    return rot


def camera_preset(
    name: str,
    num_frames: int,
    *,
    step: float = DEFAULT_STEP,
    yaw_deg: float = DEFAULT_YAW_DEG,
    orbit_radius: float = DEFAULT_ORBIT_RADIUS,
) -> np.ndarray:
    """Camera-to-world poses [num_frames, 4, 4] float32 of a named preset (see PRESETS).

    `left`/`right` turn in place by `yaw_deg` per frame; `forward`/`backward`/`strafe_*` move
    `step` per frame along the camera's z/x axis; `orbit` circles `orbit_radius` ahead,
    `yaw_deg` per frame, keeping that point centred.
    """
    if name not in PRESETS:
        raise ValueError(f"unknown camera preset {name!r}; choose one of: {', '.join(PRESETS)}")
    if num_frames < 1:
        raise ValueError(f"num_frames must be at least 1, got {num_frames}")
    t = np.arange(num_frames, dtype=np.float64)
    yaw = np.zeros(num_frames)
    pos = np.zeros((num_frames, 3))
    if name == "forward":
        pos[:, 2] = step * t
    elif name == "backward":
        pos[:, 2] = -step * t
    elif name == "strafe_right":
        pos[:, 0] = step * t
    elif name == "strafe_left":
        pos[:, 0] = -step * t
    elif name == "right":
        yaw = np.deg2rad(yaw_deg) * t
    elif name == "left":
        yaw = -np.deg2rad(yaw_deg) * t
    elif name == "orbit":
        # Circle the point (0, 0, r): the camera slides left while turning right to face it.
        yaw = np.deg2rad(yaw_deg) * t
        pos[:, 0] = -orbit_radius * np.sin(yaw)
        pos[:, 2] = orbit_radius * (1.0 - np.cos(yaw))
    poses = np.tile(np.eye(4), (num_frames, 1, 1))
    poses[:, :3, :3] = _rot_y(yaw)
    poses[:, :3, 3] = pos
    return poses.astype(np.float32)


def scale_intrinsics(intrinsics: np.ndarray, src_hw: tuple[int, int], dst_hw: tuple[int, int]) -> np.ndarray:
    """Rescale fx, fy, cx, cy from a `src_hw` image to a `dst_hw` one (a plain resize, no crop), in float32 as
    the reference's get_Ks_transformed does (a float32 tensor times the Python scale factors)."""
    sy = np.float32(dst_hw[0] / src_hw[0])
    sx = np.float32(dst_hw[1] / src_hw[1])
    return np.asarray(intrinsics, dtype=np.float32) * np.array([sx, sy, sx, sy], dtype=np.float32)
