"""Images across the browser bridge: uploaded first frames in, JPEG video frames out."""
from __future__ import annotations

import base64
import io

import numpy as np
from PIL import Image, UnidentifiedImageError

from backend.api.contract import MAX_INPUT_PIXELS

JPEG_QUALITY = 90


def encode_jpeg(frame: np.ndarray) -> bytes:
    """One uint8 RGB frame [H, W, 3] as JPEG bytes."""
    out = io.BytesIO()
    Image.fromarray(frame).save(out, format="JPEG", quality=JPEG_QUALITY)
    return out.getvalue()


UNREADABLE = "the first frame is not a picture this player can read (use a JPEG or PNG)"


def open_upload(data_url: str, max_pixels: int = MAX_INPUT_PIXELS) -> Image.Image:
    """A picture the page sent as a data URL (or bare base64), opened and its size checked, no pixel decoded yet
    (PIL opens lazily: a small compressed file can hold a huge picture); ValueError in plain words."""
    payload = data_url.split(",", 1)[1] if data_url.startswith("data:") else data_url
    try:
        image = Image.open(io.BytesIO(base64.b64decode(payload, validate=True)))
    except (ValueError, UnidentifiedImageError, OSError, Image.DecompressionBombError) as exc:
        raise ValueError(UNREADABLE) from exc
    width, height = image.size
    if width * height > max_pixels:
        image.close()
        raise ValueError(f"the first frame is {width} x {height} pixels; this player takes at most {max_pixels} "
                         f"pixels (for example {int(max_pixels ** 0.5)} x {int(max_pixels ** 0.5)})")
    return image


def rgb(image: Image.Image) -> np.ndarray:
    """An opened upload's pixels as uint8 RGB [H, W, 3] (the decode); ValueError in plain words."""
    with image:
        try:
            return np.asarray(image.convert("RGB"))
        except (ValueError, OSError, Image.DecompressionBombError) as exc:
            raise ValueError(UNREADABLE) from exc


def decode_upload(data_url: str, max_pixels: int = MAX_INPUT_PIXELS) -> np.ndarray:
    """A picture the page sent, as uint8 RGB [H, W, 3]; ValueError in plain words."""
    return rgb(open_upload(data_url, max_pixels))
