"""The owner's side of a session's replies: a whole trajectory streams every block on one request; a steered
session answers each of its requests (the first, then one per step) with one block, in order.

Both count the blocks their client has received and call `on_delivered` after each (the group loop's
doorbell: a session held back by a slow client may run again).
"""
from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Protocol

import numpy as np

from ..api.refusal import Refusal
from ..engine.blocks import BlockOutput


class Responder(Protocol):
    """One request's reply channel (a Triton response sender in production)."""

    def send_block(self, output: BlockOutput, frames: np.ndarray, decode_ms: float, final: bool) -> None: ...

    def send_error(self, refusal: Refusal) -> None: ...

    def send_place(self, position: int, wait_s: float) -> None: ...  # a non-final response without a block

    def finish(self) -> None: ...  # close the stream without data (after a cancellation)

    def is_cancelled(self) -> bool: ...  # the client went away, or an error response closed the stream


class OwnerStream:
    """A `Responder` for the group loop and the decode sender; `sent` counts the blocks clients received."""

    def __init__(self, on_delivered: Callable[[], None], lock: AbstractContextManager | None = None) -> None:
        """lock: a reentrant lock, the one the responders send under if they take one (GroupCoordinator's
        send_lock), so a send and a request's arrival never take two locks in opposite orders."""
        self.sent = 0
        self._on_delivered = on_delivered
        self._lock = lock or threading.RLock()

    def _delivered(self, responder: Responder, output: BlockOutput, frames: np.ndarray, decode_ms: float,
                   final: bool) -> None:
        """Send a block (under the lock); the caller calls `_on_delivered` once it let the lock go (a ring is a
        store round trip, which no request's arrival should wait behind)."""
        responder.send_block(output, frames, decode_ms, final)
        self.sent += 1


class WholeStream(OwnerStream):
    """A whole trajectory: one request, every block on it, the last with the final flag."""

    def __init__(self, responder: Responder, on_delivered: Callable[[], None],
                 lock: AbstractContextManager | None = None) -> None:
        super().__init__(on_delivered, lock)
        self._responder = responder

    def send_block(self, output: BlockOutput, frames: np.ndarray, decode_ms: float, final: bool) -> None:
        with self._lock:
            self._delivered(self._responder, output, frames, decode_ms, final)
        self._on_delivered()

    def send_error(self, refusal: Refusal) -> None:
        self._responder.send_error(refusal)

    def send_place(self, position: int, wait_s: float) -> None:
        with self._lock:
            self._responder.send_place(position, wait_s)

    def finish(self) -> None:
        self._responder.finish()

    def is_cancelled(self) -> bool:
        return self._responder.is_cancelled()

    def waits_on_client_since(self) -> float | None:
        """A whole trajectory never waits on its client."""
        return None


class SteeredStream(OwnerStream):
    """A steered session: blocks go to the waiting requests in order. A block computed before its request
    arrived (a held block, when the client is late and the session holds its motion) waits here and answers
    the next step at once. Requests join from Triton's thread.

    A pause (a request without a camera) is held open, without a block, until the sequence's next request or
    the session's end: the client is provably there while it is open (its cancellation says it left), so the
    idle clock stops. At most one is open."""

    def __init__(self, first: Responder, on_delivered: Callable[[], None],
                 lock: AbstractContextManager | None = None) -> None:
        super().__init__(on_delivered, lock)
        self._waiting: deque[Responder] = deque([first])
        self._ready: deque[tuple[BlockOutput, np.ndarray, float]] = deque()
        self._closing: list[Responder] = []  # end flags without a camera: answered when the session closes
        self._pause: Responder | None = None  # the open pause
        self._answered_s = time.monotonic()  # when its last waiting request was answered

    def waits_on_client_since(self) -> float | None:
        """Since when every request is answered, so the server waits on the client; None while one waits (the
        server's own time: its block runs, or waits behind other sessions' blocks) or a pause is open."""
        with self._lock:
            return None if self._waiting or self._pause is not None else self._answered_s

    def _delivered(self, responder: Responder, output: BlockOutput, frames: np.ndarray, decode_ms: float,
                   final: bool) -> None:
        super()._delivered(responder, output, frames, decode_ms, final)
        if not self._waiting:
            self._answered_s = time.monotonic()

    def add(self, responder: Responder) -> None:
        """A step's request: answered by the next block (at once if one is ready)."""
        with self._lock:
            ready = bool(self._ready)
            if ready:
                self._delivered(responder, *self._ready.popleft(), True)
            else:
                self._waiting.append(responder)
        if ready:
            self._on_delivered()

    def pause(self, responder: Responder) -> None:
        """A pause: held open until `end_pause` (a second pause ends the first) or the session's end."""
        with self._lock:
            self._end_pause()
            self._pause = responder

    def end_pause(self) -> bool:
        """The sequence's next request arrived: the open pause, if any, is answered (empty) before it is
        handled. Returns whether one was open."""
        with self._lock:
            return self._end_pause()

    def _end_pause(self) -> bool:
        pause, self._pause = self._pause, None
        if pause is None:
            return False
        pause.finish()
        if not self._waiting:  # the client was there until now: the idle clock starts again from here
            self._answered_s = time.monotonic()
        return True

    def add_closing(self, responder: Responder) -> None:
        """An end flag without a camera: answered when the session closes."""
        with self._lock:
            self._closing.append(responder)

    def send_block(self, output: BlockOutput, frames: np.ndarray, decode_ms: float, final: bool) -> None:
        with self._lock:
            waiting = bool(self._waiting)
            if waiting:  # one response per request: each is final
                self._delivered(self._waiting.popleft(), output, frames, decode_ms, True)
            else:
                self._ready.append((output, frames, decode_ms))
        if waiting:
            self._on_delivered()

    def send_error(self, refusal: Refusal) -> None:
        self._close(lambda r: r.send_error(refusal))

    def send_place(self, position: int, wait_s: float) -> None:
        """The session's place in line, on its first request (the one a slot will answer)."""
        with self._lock:
            if self._waiting:
                self._waiting[0].send_place(position, wait_s)

    def finish(self) -> None:
        """The session ended: requests still waiting (an end flag without a camera) close without a block."""
        self._close(lambda r: r.finish())

    def _close(self, answer: Callable[[Responder], None]) -> None:
        with self._lock:
            for responder in self._unanswered():
                answer(responder)
            self._waiting.clear()
            self._closing.clear()
            self._pause = None
            self._ready.clear()

    def is_cancelled(self) -> bool:
        with self._lock:
            return any(r.is_cancelled() for r in self._unanswered())

    def _unanswered(self) -> list[Responder]:
        """Every request not answered yet (under the lock)."""
        return [*self._waiting, *self._closing, *([self._pause] if self._pause is not None else [])]
