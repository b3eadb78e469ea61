"""Each rank's decode thread: runs the VAE decode of every block it takes part in (its sessions', and its band
of every shared decode) and sends its own sessions' frames, in order, off the group loop."""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from ..api.refusal import Refusal
from ..engine.blocks import BlockOutput
from ..engine.rollout import WorldModelEngine
from ..engine.session import Session
from .streams import Responder
from .threads import use_threads

log = logging.getLogger(__name__)


class DecodeSender:
    """Decodes and sends on its own thread, in submission order (so each stream stays ordered)."""

    def __init__(self, engine: WorldModelEngine, threads: int | None = None,
                 on_failure: Callable[[], None] = lambda: None,
                 on_stream_failed: Callable[[str], None] = lambda session_id: None) -> None:
        """threads: torch threads of the decode (see threads.CoreSplit), None leaves them as they are;
        on_failure: called when a shared decode fails (the group loop must wake and fail); on_stream_failed:
        with the session's id when a decode of this rank's own fails (the session must end)."""
        self.engine = engine
        self.threads = threads
        self.on_failure = on_failure
        self.on_stream_failed = on_stream_failed
        self.failure: Exception | None = None  # a shared decode failed: its ranks' exchanges are out of step
        self._failed_sessions: set[str] = set()  # a decode of theirs failed: their later blocks are not sent
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()  # None stops the thread
        self._thread = threading.Thread(target=self._run, name="lingbot-decode-sender", daemon=True)
        self._thread.start()

    def block(self, responder: Responder | None, session: Session, output: BlockOutput, final: bool) -> None:
        """Decode a block (this rank's band when the decode is shared) and send it if this rank answers it."""
        shared = session.split_decode

        def send() -> None:
            start = time.perf_counter()
            if shared and self.failure is not None:  # the group is failing: do not wait on its exchanges again
                return
            if session.id in self._failed_sessions:  # a block the client must not get after a missing one
                return
            try:
                frames = self.engine.decode(session, output)
            except Exception as exc:
                log.exception("decoding block %d of session %s failed", output.block_index, session.id)
                if shared:  # the other ranks wait in this decode's exchanges: the group must fail
                    self.failure = RuntimeError(repr(exc))  # not its traceback: its frames hold the engine
                    self.on_failure()
                else:
                    self._failed_sessions.add(session.id)
                    self.on_stream_failed(session.id)
                return
            if responder is not None:
                responder.send_block(output, frames, (time.perf_counter() - start) * 1000.0, final)

        self._queue.put(send)

    def error(self, responder: Responder, refusal: Refusal) -> None:
        self._queue.put(lambda: responder.send_error(refusal))

    def finish(self, responder: Responder) -> None:
        self._queue.put(responder.finish)

    def close(self, timeout_s: float = 60.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        use_threads(self.threads)
        while (task := self._queue.get()) is not None:
            try:
                task()
            except Exception:  # one stream's failure must not stop the others
                log.exception("sending a response failed")
