"""A count of events over a sliding window: at most `limit` in any `window_s` seconds."""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable


class Rate:
    def __init__(self, limit: int, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit, self.window_s, self.clock = limit, window_s, clock
        self._times: deque[float] = deque()

    def take(self) -> float | None:
        """Count one event now: None if it is within the limit, else the seconds until one would be (not counted)."""
        now = self.clock()
        while self._times and self._times[0] <= now - self.window_s:
            self._times.popleft()
        if len(self._times) >= self.limit:
            return self._times[0] + self.window_s - now
        self._times.append(now)
        return None
