"""A session request and its validation (numpy only: shared by the engine, the Triton adapter and clients)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .errors import InputError

DEFAULT_HFOV_DEG = 60.0


def default_intrinsics(num_frames: int, height: int, width: int, hfov_deg: float = DEFAULT_HFOV_DEG) -> np.ndarray:
    """Intrinsics [num_frames, 4] float32 (fx, fy, cx, cy) of a centred pinhole with square pixels."""
    if not 0.0 < hfov_deg < 180.0:
        raise ValueError(f"horizontal FOV must be in (0, 180) degrees, got {hfov_deg}")
    focal = 0.5 * width / math.tan(math.radians(hfov_deg) / 2.0)
    row = np.array([focal, focal, width / 2.0, height / 2.0], dtype=np.float32)
    return np.tile(row, (num_frames, 1))


@dataclass
class SessionRequest:
    image: np.ndarray  # uint8 [H, W, 3], any size: resized to (height, width)
    prompt: str
    poses: np.ndarray  # float32 [num_frames, 4, 4] camera-to-world
    num_frames: int
    seed: int
    height: int
    width: int
    intrinsics: np.ndarray | None = None  # float32 [num_frames, 4]; default: DEFAULT_HFOV_DEG pinhole
    decode: bool = True
    return_latents: bool = True

    def camera_intrinsics(self) -> np.ndarray:
        if self.intrinsics is None:
            return default_intrinsics(self.num_frames, self.height, self.width)
        return self.intrinsics


def check_request(request: SessionRequest) -> None:
    """Checks of the inputs' types, shapes and values (the engine checks sizes first). Raises InputError."""
    image = request.image
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3 or min(image.shape[:2]) < 1:
        raise InputError(f"image must be UINT8 [H, W, 3]; got {image.dtype} {list(image.shape)}")
    if not request.prompt.strip():
        raise InputError("prompt is empty")
    frames = request.num_frames
    poses = request.poses
    if poses.dtype != np.float32 or poses.shape != (frames, 4, 4):
        raise InputError(f"camera_poses must be FP32 [{frames}, 4, 4]; got {poses.dtype} {list(poses.shape)}")
    if not np.isfinite(poses).all():
        raise InputError("camera_poses holds NaN or Inf")
    if not np.allclose(poses[:, 3], [0.0, 0.0, 0.0, 1.0], atol=1e-4):
        raise InputError("camera_poses: the last row of every 4x4 pose must be [0, 0, 0, 1]")
    rotations = poses[:, :3, :3].astype(np.float64)
    gram = rotations @ rotations.transpose(0, 2, 1)
    worst = int(np.abs(gram - np.eye(3)).max(axis=(1, 2)).argmax())
    if not np.allclose(gram, np.eye(3), atol=1e-2) or (np.linalg.det(rotations) <= 0).any():
        raise InputError(f"camera_poses[{worst}]: the 3x3 block is not a rotation (orthonormal, det +1)")
    if request.intrinsics is not None:
        k = request.intrinsics
        if k.dtype != np.float32 or k.shape != (frames, 4):
            raise InputError(f"camera_intrinsics must be FP32 [{frames}, 4]; got {k.dtype} {list(k.shape)}")
        if not np.isfinite(k).all() or (k[:, :2] <= 0).any():
            raise InputError("camera_intrinsics must be finite with fx, fy > 0")
