"""The real-time factor of a stream: seconds of video delivered per second of delivery."""
from __future__ import annotations

from client.video import DEFAULT_FPS


class DeliveryRate:
    """Counted from the first block's arrival (before it the server starts up), so at a steady pace it is one
    block's play time over the interval between blocks; 1 or more keeps up with playback."""

    def __init__(self, fps: float = DEFAULT_FPS) -> None:
        self.fps = fps
        self.first_arrival_s: float | None = None
        self.frames_since_first = 0

    def add(self, frames: int, arrival_s: float) -> float | None:
        """Record a block; the factor so far, None until a second block has arrived."""
        if self.first_arrival_s is None:
            self.first_arrival_s = arrival_s
            return None
        self.frames_since_first += frames
        elapsed = arrival_s - self.first_arrival_s
        return self.frames_since_first / self.fps / elapsed if elapsed > 0 else None
