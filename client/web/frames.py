"""Images across the browser bridge: uploaded first frames in, JPEG video frames out."""
from __future__ import annotations

import base64
import io

import numpy as np
from PIL import Image, UnidentifiedImageError

JPEG_QUALITY = 90


def encode_jpeg(frame: np.ndarray) -> bytes:
    """One uint8 RGB frame [H, W, 3] as JPEG bytes."""
    out = io.BytesIO()
    Image.fromarray(frame).save(out, format="JPEG", quality=JPEG_QUALITY)
    return out.getvalue()


def decode_upload(data_url: str) -> np.ndarray:
    """A picture the page sent as a data URL (or bare base64) as uint8 RGB [H, W, 3]; ValueError in plain words."""
    payload = data_url.split(",", 1)[1] if data_url.startswith("data:") else data_url
    try:
        with Image.open(io.BytesIO(base64.b64decode(payload, validate=True))) as image:
            return np.asarray(image.convert("RGB"))
    except (ValueError, UnidentifiedImageError, OSError) as exc:
        raise ValueError("the first frame is not a picture this player can read (use a JPEG or PNG)") from exc
