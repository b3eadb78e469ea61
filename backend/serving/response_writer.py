"""Each rank's writer thread: decodes its sessions' blocks and sends them, in order, off the group loop."""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Protocol

import numpy as np

from ..engine.rollout import BlockOutput, Session, WorldModelEngine
from .messages import DECODE_FAILED
from .threads import use_threads

log = logging.getLogger(__name__)


class Responder(Protocol):
    """One request's reply channel (a Triton response sender in production)."""

    def send_block(self, output: BlockOutput, frames: np.ndarray, decode_ms: float, final: bool) -> None: ...

    def send_error(self, message: str) -> None: ...

    def finish(self) -> None: ...  # close the stream without data (after a cancellation)

    def is_cancelled(self) -> bool: ...  # the client went away, or an error response closed the stream


class ResponseWriter:
    """Decodes and sends on its own thread, in submission order (so each stream stays ordered)."""

    def __init__(self, engine: WorldModelEngine, threads: int | None = None) -> None:
        self.engine = engine
        self.threads = threads  # torch threads of the decode (see threads.CoreSplit); None: as they are
        self.delivered: dict[str, int] = {}  # blocks sent per session, written by the writer thread
        self._queue: queue.SimpleQueue[tuple[Responder, Callable[[], None]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="lingbot-response-writer", daemon=True)
        self._thread.start()

    def block(self, responder: Responder, session: Session, output: BlockOutput, final: bool) -> None:
        def send() -> None:
            start = time.perf_counter()
            frames = self.engine.decode(session, output)
            responder.send_block(output, frames, (time.perf_counter() - start) * 1000.0, final)
            self.delivered[session.id] = output.block_index + 1

        self._queue.put((responder, send))

    def error(self, responder: Responder, message: str) -> None:
        self._queue.put((responder, lambda: responder.send_error(message)))

    def finish(self, responder: Responder) -> None:
        self._queue.put((responder, responder.finish))

    def close(self, timeout_s: float = 60.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        use_threads(self.threads)
        while (item := self._queue.get()) is not None:
            responder, task = item
            try:
                task()
            except Exception:  # one stream's failure must not stop the others
                log.exception("decoding or sending a response failed")
                try:  # the stream ends with the error; the loop then sees it closed and drops the session
                    responder.send_error(DECODE_FAILED)
                except Exception:
                    log.exception("sending the error response failed too")
