"""The owner's side of a session's replies: a whole trajectory streams every block on one request; a steered
session answers each of its requests (the first, then one per step) with one block, in order.

Both count the blocks their client has received (`sent`). Only the intake's thread (serving/intake) touches a
stream, so none takes a lock.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

import numpy as np

from ..api.codec import SnapshotNotice
from ..api.refusal import Refusal
from ..engine.blocks import BlockOutput


class Responder(Protocol):
    """One request's reply channel (a Triton response sender in production)."""

    def send_block(self, output: BlockOutput, frames: np.ndarray, decode_ms: float, final: bool) -> None: ...

    def send_error(self, refusal: Refusal) -> None: ...

    def send_place(self, position: int, wait_s: float) -> None: ...  # a non-final response without a block

    def send_notice(self, notice: SnapshotNotice) -> None: ...  # a save's outcome: a non-final response, no block

    def send_saves(self, listing: str) -> None: ...  # the key's snapshots (request parameter saves): final

    def finish(self) -> None: ...  # close the stream without data (after a cancellation)

    def is_cancelled(self) -> bool: ...  # the client went away, or an error response closed the stream


class CountedStream:
    """`sent`: the blocks the session's client received (a resumed world's count goes on from its snapshot's)."""

    def __init__(self, sent: int = 0) -> None:
        self.sent = sent

    def _deliver(self, responder: Responder, output: BlockOutput, frames: np.ndarray, decode_ms: float,
                 final: bool) -> None:
        responder.send_block(output, frames, decode_ms, final)
        self.sent += 1


class WholeStream(CountedStream):
    """A whole trajectory: one request, every block on it, the last with the final flag."""

    def __init__(self, responder: Responder) -> None:
        super().__init__()
        self._responder = responder

    def send_block(self, output: BlockOutput, frames: np.ndarray, decode_ms: float, final: bool) -> None:
        self._deliver(self._responder, output, frames, decode_ms, final)

    def send_error(self, refusal: Refusal) -> None:
        self._responder.send_error(refusal)

    def send_place(self, position: int, wait_s: float) -> None:
        self._responder.send_place(position, wait_s)

    def finish(self) -> None:
        self._responder.finish()

    def is_cancelled(self) -> bool:
        return self._responder.is_cancelled()

    def waits_on_client_since(self) -> float | None:
        """A whole trajectory never waits on its client."""
        return None


class SteeredStream(CountedStream):
    """A steered session: blocks go to the waiting requests in order. A block computed before its request
    arrived (a held block, when the client is late and the session holds its motion) waits here and answers
    the next step at once.

    A pause (a request without a camera) is held open, without a block, until the sequence's next request or
    the session's end: the client is provably there while it is open (its cancellation says it left), so the
    idle clock stops. At most one is open."""

    def __init__(self, first: Responder, sent: int = 0) -> None:
        super().__init__(sent)
        self._waiting: deque[Responder] = deque([first])
        self._ready: deque[tuple[BlockOutput, np.ndarray, float]] = deque()
        self._closing: list[Responder] = []  # end flags without a camera: answered when the session closes
        self._pause: Responder | None = None  # the open pause
        self._notices: deque[SnapshotNotice] = deque()  # saves' outcomes told when the client next has a request open
        self._answered_s = time.monotonic()  # when its last waiting request was answered
        self._served_s = self._answered_s  # when its last block was sent

    def waits_on_client_since(self) -> float | None:
        """Since when every request is answered, so the server waits on the client; None while one waits (the
        server's own time: its block runs, or waits behind other sessions' blocks) or a pause is open."""
        return None if self._waiting or self._pause is not None else self._answered_s

    def asks_no_block_since(self) -> float | None:
        """Since when no request of the session asks for a block (its last block's sending; a pause asks for none);
        None while one waits for its block or its end."""
        return None if self._waiting or self._closing else self._served_s

    def _deliver(self, responder: Responder, output: BlockOutput, frames: np.ndarray, decode_ms: float,
                 final: bool) -> None:
        super()._deliver(responder, output, frames, decode_ms, final)
        self._served_s = time.monotonic()
        if not self._waiting:
            self._answered_s = self._served_s

    def add(self, responder: Responder) -> None:
        """A step's request: answered by the next block (at once if one is ready)."""
        self._tell_notices(responder)
        if self._ready:
            self._deliver(responder, *self._ready.popleft(), True)
        else:
            self._waiting.append(responder)

    def pause(self, responder: Responder) -> None:
        """A pause: held open until `end_pause` (a second pause ends the first) or the session's end."""
        self.end_pause()
        self._tell_notices(responder)
        self._pause = responder

    def end_pause(self) -> None:
        """The sequence's next request arrived: the open pause, if any, is answered (empty) before it is
        handled."""
        pause, self._pause = self._pause, None
        if pause is None:
            return
        pause.finish()
        if not self._waiting:  # the client was there until now: the idle clock starts again from here
            self._answered_s = time.monotonic()

    def add_closing(self, responder: Responder) -> None:
        """An end flag without a camera: answered when the session closes."""
        self._tell_notices(responder)
        self._closing.append(responder)

    def send_block(self, output: BlockOutput, frames: np.ndarray, decode_ms: float, final: bool) -> None:
        if self._waiting:  # one response per request: each is final
            self._deliver(self._waiting.popleft(), output, frames, decode_ms, True)
        else:
            self._ready.append((output, frames, decode_ms))

    def send_error(self, refusal: Refusal) -> None:
        self._close(lambda r: r.send_error(refusal))

    def send_place(self, position: int, wait_s: float) -> None:
        """The session's place in the queue, on its first request (the one a slot will answer)."""
        if self._waiting:
            self._waiting[0].send_place(position, wait_s)

    def send_notice(self, notice: SnapshotNotice) -> None:
        """A save's outcome, on a request the client has open (else on its next one)."""
        unanswered = self._unanswered()
        if unanswered:
            unanswered[0].send_notice(notice)
        else:
            self._notices.append(notice)

    def _tell_notices(self, responder: Responder) -> None:
        while self._notices:
            responder.send_notice(self._notices.popleft())

    def finish(self) -> None:
        """The session ended: requests still waiting (an end flag without a camera) close without a block."""
        self._close(lambda r: r.finish())

    def _close(self, answer: Callable[[Responder], None]) -> None:
        for responder in self._unanswered():
            answer(responder)
        self._waiting.clear()
        self._closing.clear()
        self._pause = None
        self._ready.clear()

    def is_cancelled(self) -> bool:
        return any(r.is_cancelled() for r in self._unanswered())

    def _unanswered(self) -> list[Responder]:
        """Every request not answered yet."""
        return [*self._waiting, *self._closing, *([self._pause] if self._pause is not None else [])]


OwnerStream = WholeStream | SteeredStream  # what the intake answers a session's client through
