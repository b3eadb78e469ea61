"""Video output: an MP4 written block by block, and a PNG contact sheet of every k-th frame."""
from __future__ import annotations

from collections.abc import Generator
from pathlib import Path
from types import TracebackType

import imageio_ffmpeg
import numpy as np
from PIL import Image, ImageDraw

DEFAULT_FPS = 16.0  # LingBot-World's native frame rate


def _as_frames(frames: np.ndarray) -> np.ndarray:
    """Check for uint8 RGB frames [n, H, W, 3] (a single [H, W, 3] frame is accepted)."""
    frames = np.asarray(frames)
    if frames.ndim == 3:
        frames = frames[None]
    if frames.ndim != 4 or frames.shape[3] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"expected uint8 RGB frames [n, H, W, 3], got {frames.dtype} {list(frames.shape)}")
    return frames


class Mp4Writer:
    """H.264 MP4 encoder fed frames as they arrive; ffmpeg starts on the first frame.

    Use as a context manager: the file is finalised on exit, also when an exception ends
    the stream early (it then holds the frames appended so far).
    """

    def __init__(self, path: str | Path, fps: float = DEFAULT_FPS, quality: float = 8.0) -> None:
        if fps <= 0:
            raise ValueError(f"fps must be positive, got {fps}")
        self.path = Path(path)
        self.fps = fps
        self.quality = quality
        self.frames_written = 0
        self._size: tuple[int, int] | None = None  # (H, W) fixed by the first frame
        self._encoder: Generator[None, bytes, None] | None = None

    def append(self, frames: np.ndarray) -> None:
        frames = _as_frames(frames)
        if len(frames) == 0:
            return
        size = frames.shape[1:3]
        if self._encoder is None:
            if size[0] % 2 or size[1] % 2:
                raise ValueError(f"H.264 needs even frame sizes, got {size[0]}x{size[1]} (HxW)")
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._encoder = imageio_ffmpeg.write_frames(
                str(self.path), (size[1], size[0]), fps=self.fps, quality=self.quality,
                codec="libx264", macro_block_size=2,
            )
            self._encoder.send(None)  # start ffmpeg
            self._size = size
        elif size != self._size:
            raise ValueError(f"frame size changed mid-video from {self._size} to {size} (HxW)")
        for frame in frames:
            self._encoder.send(np.ascontiguousarray(frame).tobytes())
        self.frames_written += len(frames)

    def close(self) -> None:
        """Flush and finalise the file; safe to call twice."""
        if self._encoder is not None:
            encoder, self._encoder = self._encoder, None
            encoder.close()

    def __enter__(self) -> Mp4Writer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


class ContactSheet:
    """Collects a thumbnail of every `every`-th frame (frame 0 first) into a grid image, each labelled with its
    frame and block; the grid has no empty cells (its column count divides the thumbnails, near `columns`). The
    thumbnails of a block where a prompt event took effect are framed in EVENT_COLOUR."""

    EVENT_COLOUR = (255, 200, 0)
    LABEL_HEIGHT = 12  # a strip under each thumbnail: "frame F  block B" (or "fF bB" when narrow)

    def __init__(self, every: int = 8, columns: int = 6, thumb_width: int = 208) -> None:
        if every < 1 or columns < 1 or thumb_width < 1:
            raise ValueError("contact sheet every, columns and thumb_width must be positive")
        self.every = every
        self.columns = columns
        self.thumb_width = thumb_width
        self._thumbs: list[np.ndarray] = []
        self.frames_seen = 0  # frames offered so far, to keep the stride across blocks

    def add(self, frames: np.ndarray, block_index: int = 0, event: bool = False) -> None:
        """event: the block is the first under a new prompt (its thumbnails are framed)."""
        frames = _as_frames(frames)
        first = -self.frames_seen % self.every  # index in this block of the next frame to keep
        for i in range(first, len(frames), self.every):
            frame = frames[i]
            height = max(1, round(frame.shape[0] * self.thumb_width / frame.shape[1]))
            thumb = Image.new("RGB", (self.thumb_width, height + self.LABEL_HEIGHT))
            thumb.paste(Image.fromarray(frame).resize((self.thumb_width, height), Image.BILINEAR))
            draw = ImageDraw.Draw(thumb)
            label = f"frame {self.frames_seen + i}  block {block_index}"
            if draw.textlength(label) > self.thumb_width - 4:  # narrow thumbnails get the short form
                label = f"f{self.frames_seen + i} b{block_index}"
            draw.text((2, height), label, fill=(255, 255, 255))
            if event:
                draw.rectangle((0, 0, self.thumb_width - 1, height - 1), outline=self.EVENT_COLOUR, width=2)
            self._thumbs.append(np.asarray(thumb))
        self.frames_seen += len(frames)

    def grid_columns(self) -> int:
        """A divisor of the thumbnail count: the largest up to `columns` if at least half of it, else the
        smallest above it (a prime count makes one row)."""
        n = len(self._thumbs)
        divisors = [d for d in range(1, n + 1) if n % d == 0]
        below = max(d for d in divisors if d <= self.columns)
        return below if 2 * below >= min(self.columns, n) else min(d for d in divisors if d > self.columns)

    def image(self) -> np.ndarray:
        """The sheet as uint8 [rows * (h + label), columns * w, 3]."""
        if not self._thumbs:
            raise ValueError("contact sheet is empty: no frames were received")
        h, w = self._thumbs[0].shape[:2]
        columns = self.grid_columns()
        rows = len(self._thumbs) // columns
        sheet = np.zeros((rows * h, columns * w, 3), dtype=np.uint8)
        for i, thumb in enumerate(self._thumbs):
            r, c = divmod(i, columns)
            sheet[r * h : (r + 1) * h, c * w : (c + 1) * w] = thumb
        return sheet

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(self.image()).save(path, format="PNG")
