"""First-frame images: read one from disk, or draw a synthetic test scene."""
from __future__ import annotations

from pathlib import Path

import imageio.v3 as iio
import numpy as np


def load_image(path: str | Path) -> np.ndarray:
    """Read an image file as uint8 RGB [H, W, 3] (grey is expanded, alpha dropped)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"image not found: {path}")
    try:
        image = iio.imread(path)
    except Exception as exc:  # imageio raises plugin-specific errors
        raise ValueError(f"cannot read image {path}: {exc}") from exc
    if image.ndim == 2:
        image = np.repeat(image[:, :, None], 3, axis=2)
    if image.ndim != 3 or image.shape[2] not in (3, 4):
        raise ValueError(f"image {path} has shape {image.shape}; expected an RGB or RGBA picture")
    if image.dtype != np.uint8:
        raise ValueError(f"image {path} has {image.dtype} pixels; save it as an 8-bit RGB JPEG or PNG")
    return np.ascontiguousarray(image[:, :, :3])


def synthetic_image(height: int, width: int) -> np.ndarray:
    """A uint8 [height, width, 3] scene: sky gradient over a checkered ground plane to the horizon."""
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float64)
    horizon = height / 2.0
    image = np.empty((height, width, 3), dtype=np.float64)
    sky = np.clip(ys / horizon, 0.0, 1.0)[..., None]
    image[:] = (1.0 - sky) * np.array([70.0, 130.0, 220.0]) + sky * np.array([200.0, 225.0, 250.0])
    # Ground plane one unit below a pinhole with focal length = width: depth from the row.
    below = ys > horizon + 0.5
    depth = width / np.maximum(ys - horizon, 0.5)
    lateral = (xs - width / 2.0) * depth / width
    checker = (np.floor(lateral) + np.floor(depth)).astype(np.int64) % 2 == 0
    fade = np.exp(-depth / 40.0)[..., None]  # distant squares fade into the haze
    ground = np.where(checker[..., None], [90.0, 150.0, 70.0], [200.0, 190.0, 150.0])
    ground = fade * ground + (1.0 - fade) * np.array([200.0, 225.0, 250.0])
    image[below] = ground[below]
    return np.clip(image, 0, 255).astype(np.uint8)
