"""Cancellations as doorbell rings: Triton's Python backend has no cancellation callback, so this thread reads
the cancelled flags of this rank's open streams (a local call, no store, no collective) every `every_s` and
rings when one turns, so an idle group wakes for it."""
from __future__ import annotations

import threading
from collections.abc import Callable

from .streams import OwnerStream

EVERY_S = 0.5


class CancelWatch:
    def __init__(self, streams: Callable[[], list[OwnerStream]], ring: Callable[[], None],
                 every_s: float = EVERY_S) -> None:
        self._streams = streams
        self._ring = ring
        self._every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lingbot-cancel-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5.0)

    def _run(self) -> None:
        rung: set[int] = set()  # streams already reported (by id: each rings once)
        while not self._stop.wait(self._every_s):
            streams = self._streams()
            cancelled = {id(s) for s in streams if s.is_cancelled()}
            if cancelled - rung:
                self._ring()
            rung = cancelled
