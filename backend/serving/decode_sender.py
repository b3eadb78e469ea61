"""Each rank's decode thread: runs the VAE decode of every block it takes part in (its sessions', and its band
of every shared decode) and sends its own sessions' frames, in order, off the group loop."""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from ..engine.blocks import BlockOutput
from ..engine.rollout import WorldModelEngine
from ..engine.session import Session
from .messages import DECODE_FAILED, GROUP_FAILED
from .streams import Responder
from .threads import use_threads

log = logging.getLogger(__name__)


class DecodeSender:
    """Decodes and sends on its own thread, in submission order (so each stream stays ordered)."""

    def __init__(self, engine: WorldModelEngine, threads: int | None = None,
                 on_failure: Callable[[], None] = lambda: None) -> None:
        """threads: torch threads of the decode (see threads.CoreSplit), None leaves them as they are;
        on_failure: called when a shared decode fails (the group loop must wake and fail)."""
        self.engine = engine
        self.threads = threads
        self.on_failure = on_failure
        self.failure: Exception | None = None  # a shared decode failed: its ranks' exchanges are out of step
        # (responder, task, the error its stream gets if the task fails); None stops the thread
        self._queue: queue.SimpleQueue[tuple[Responder | None, Callable[[], None], str | None] | None] = (
            queue.SimpleQueue())
        self._thread = threading.Thread(target=self._run, name="lingbot-decode-sender", daemon=True)
        self._thread.start()

    def block(self, responder: Responder | None, session: Session, output: BlockOutput, final: bool) -> None:
        """Decode a block (this rank's band when the decode is shared) and send it if this rank answers it."""
        shared = session.split_decode

        def send() -> None:
            start = time.perf_counter()
            if shared and self.failure is not None:  # the group is failing: do not wait on its exchanges again
                raise RuntimeError("an earlier shared decode failed") from self.failure
            try:
                frames = self.engine.decode(session, output)
            except Exception as exc:
                if shared:  # the other ranks wait in this decode's exchanges: the group must fail
                    self.failure = RuntimeError(repr(exc))  # not its traceback: its frames hold the engine
                    self.on_failure()
                raise
            if responder is not None:
                responder.send_block(output, frames, (time.perf_counter() - start) * 1000.0, final)

        # A shared decode fails with its group (a peer died, or left the exchanges): say so to the client.
        self._queue.put((responder, send, GROUP_FAILED if shared else DECODE_FAILED))

    def error(self, responder: Responder, message: str) -> None:
        self._queue.put((responder, lambda: responder.send_error(message), None))

    def finish(self, responder: Responder) -> None:
        self._queue.put((responder, responder.finish, None))

    def close(self, timeout_s: float = 60.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        use_threads(self.threads)
        while (item := self._queue.get()) is not None:
            responder, task, failed = item
            try:
                task()
            except Exception:  # one stream's failure must not stop the others
                log.exception("decoding or sending a response failed")
                if responder is None:
                    continue
                try:  # the stream ends with the error; the loop then sees it closed and drops the session
                    responder.send_error(failed or DECODE_FAILED)
                except Exception:
                    log.exception("sending the error response failed too")
