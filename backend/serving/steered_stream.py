"""A steered session's replies on its owning rank: each request (the first, then one per step) gets one block.

Blocks go to the waiting requests in order. A block computed before its request arrived (a held block, when
the client is late and the session holds its motion) waits here and answers the next step at once.
"""
from __future__ import annotations

import threading
import time
from collections import deque

import numpy as np

from ..engine.rollout import BlockOutput
from .response_writer import Responder


class SteeredStream:
    """Implements `Responder` for the group loop and the writer; requests join it from Triton's thread."""

    def __init__(self, key: str, first: Responder) -> None:
        self.key = key
        self.sent = 0  # blocks delivered to clients
        self.ending = False  # the client sent the end flag
        self.expiring = False  # this rank has told the group to end it (idle or too long)
        self.started_s = self.last_step_s = time.monotonic()
        self._waiting: deque[Responder] = deque([first])
        self._ready: deque[tuple[BlockOutput, np.ndarray, float]] = deque()
        self._closing: list[Responder] = []  # end flags without a camera: answered when the session closes
        self._closed = False
        self._lock = threading.Lock()

    def add(self, responder: Responder) -> None:
        """A step's request: answered by the next block (at once if one is ready)."""
        with self._lock:
            self.last_step_s = time.monotonic()
            if self._ready:
                self._deliver(responder, *self._ready.popleft())
            else:
                self._waiting.append(responder)

    def add_closing(self, responder: Responder) -> None:
        with self._lock:
            self.last_step_s = time.monotonic()
            self._closing.append(responder)

    def send_block(self, output: BlockOutput, frames: np.ndarray, decode_ms: float, final: bool) -> None:
        with self._lock:
            if self._waiting:
                self._deliver(self._waiting.popleft(), output, frames, decode_ms)
            else:
                self._ready.append((output, frames, decode_ms))

    def _deliver(self, responder: Responder, output: BlockOutput, frames: np.ndarray, decode_ms: float) -> None:
        responder.send_block(output, frames, decode_ms, True)  # one response per request
        self.sent += 1

    def send_error(self, message: str) -> None:
        with self._lock:
            self._closed = True
            for responder in [*self._waiting, *self._closing]:
                responder.send_error(message)
            self._waiting.clear()
            self._closing.clear()
            self._ready.clear()

    def finish(self) -> None:
        """The session ended: requests still waiting (an end flag without a camera) close without a block."""
        with self._lock:
            self._closed = True
            for responder in [*self._waiting, *self._closing]:
                responder.finish()
            self._waiting.clear()
            self._closing.clear()
            self._ready.clear()

    def is_cancelled(self) -> bool:
        with self._lock:
            return self._closed or any(r.is_cancelled() for r in (*self._waiting, *self._closing))
