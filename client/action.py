"""Action directories in the LingBot-World reference layout.

    DIR/image.jpg        first frame (or image.jpeg / image.png)
    DIR/poses.npy        [N, 4, 4] camera-to-world, OpenCV axes
    DIR/intrinsics.npy   [N, 4] fx, fy, cx, cy in pixels of a 480x832 frame, whatever image.jpg's size
                         (the reference scales them from 480x832 to the output size)
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from client.camera import scale_intrinsics
from client.images import load_image

IMAGE_NAMES = ("image.jpg", "image.jpeg", "image.png")
POSES_NAME = "poses.npy"
INTRINSICS_NAME = "intrinsics.npy"
INTRINSICS_HW = (480, 832)  # the frame size intrinsics.npy is given for (the reference's get_Ks_transformed)


class ActionDirError(ValueError):
    """An action directory is missing a file or holds arrays of the wrong shape."""


@dataclass(frozen=True)
class Action:
    image: np.ndarray  # uint8 [H0, W0, 3], as stored
    poses: np.ndarray  # float32 [num_frames, 4, 4]
    intrinsics: np.ndarray  # float32 [num_frames, 4], in pixels of the requested (height, width)


def _load_array(path: Path, row_shape: tuple[int, ...], num_frames: int) -> np.ndarray:
    if not path.is_file():
        raise ActionDirError(f"missing {path.name} in action directory {path.parent}")
    try:
        array = np.load(path, allow_pickle=False)
    except (ValueError, OSError) as exc:
        raise ActionDirError(f"cannot read {path}: {exc}") from exc
    expected = "[N, " + ", ".join(map(str, row_shape)) + "]"
    if array.ndim != 1 + len(row_shape) or array.shape[1:] != row_shape:
        raise ActionDirError(f"{path} has shape {list(array.shape)}; expected {expected}")
    if not np.issubdtype(array.dtype, np.number) or not np.isfinite(array).all():
        raise ActionDirError(f"{path} must hold finite numbers")
    if len(array) < num_frames:
        raise ActionDirError(
            f"{path} has {len(array)} frames but {num_frames} were requested; "
            f"ask for at most {len(array)} frames or extend the file"
        )
    return array[:num_frames].astype(np.float32)


def load_action_dir(path: str | Path, num_frames: int, height: int, width: int) -> Action:
    """Load the first `num_frames` poses and intrinsics, the latter rescaled from 480x832 to (height, width)."""
    path = Path(path)
    if not path.is_dir():
        raise ActionDirError(f"action directory not found: {path}")
    image_path = next((path / n for n in IMAGE_NAMES if (path / n).is_file()), None)
    if image_path is None:
        raise ActionDirError(f"missing first-frame image in {path}: expected one of {', '.join(IMAGE_NAMES)}")
    image = load_image(image_path)
    poses = _load_array(path / POSES_NAME, (4, 4), num_frames)
    intrinsics = _load_array(path / INTRINSICS_NAME, (4,), num_frames)
    return Action(image, poses, scale_intrinsics(intrinsics, INTRINSICS_HW, (height, width)))
