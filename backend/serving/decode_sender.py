"""Each rank's decode thread: runs the VAE decode of every block it takes part in (its own sessions', and its band
of every shared decode), off the group loop, and hands its own sessions' frames to the intake in order, each
session's ending after its last block, and a saved session's decoder state to the snapshot writer after the
decode of the block it was saved after."""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from ..api.refusal import Refusal
from ..engine.blocks import BlockOutput
from ..engine.session import Decoding
from ..engine.snapshot import sessions as snapshots
from ..engine.snapshot.files import Part
from ..model.tiny_vae import StreamingTinyDecoder
from ..model.vae import StreamingVae
from . import mail
from .threads import use_threads

log = logging.getLogger(__name__)


class DecodeSender:
    """Decodes on its own thread, in the order the group loop hands it blocks (so each stream stays ordered)."""

    def __init__(self, vae: StreamingVae | StreamingTinyDecoder, rank: int,
                 to_intake: Callable[[mail.IntakeLetter], None], to_loop: Callable[[mail.LoopLetter], None],
                 threads: int | None = None) -> None:
        """vae: the engine's decoder (this thread's; the group loop's thread runs the rest of the engine); to_intake:
        the intake's inbox (frames, endings); to_loop: the group loop's inbox and doorbell (a failed decode);
        threads: torch threads of the decode (see threads.CoreSplit), None leaves them as they are."""
        self.vae: StreamingVae | StreamingTinyDecoder | None = vae
        self.rank = rank
        self.threads = threads
        self._to_intake, self._to_loop = to_intake, to_loop
        self._shared_failed = False  # a shared decode failed: the ranks' exchanges are out of step
        self._failed_sessions: set[str] = set()  # a decode of theirs failed: their later blocks are not sent
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()  # None stops the thread
        self._thread = threading.Thread(target=self._run, name="lingbot-decode-sender", daemon=True)
        self._thread.start()

    def block(self, decoding: Decoding, output: BlockOutput, final: bool, owned: bool) -> None:
        """Decode a block (this rank's band when the decode is shared); its frames go to the intake if this rank
        owns the session. `decoding` is this thread's from the session's first block on (engine.session)."""
        sid, shared = decoding.session_id, decoding.split

        def decode() -> None:
            start = time.perf_counter()
            if shared and self._shared_failed:  # the group is failing: do not wait on its exchanges again
                return
            if sid in self._failed_sessions:  # a block the client must not get after a missing one
                return
            try:
                frames = decoding.frames(self.vae, output)
            except Exception as exc:
                log.exception("decoding block %d of session %s failed", output.block_index, sid)
                if shared:  # the other ranks wait in this decode's exchanges: the group must fail
                    self._shared_failed = True
                    self._to_loop(mail.SharedDecodeFailed(repr(exc)))  # not its traceback: its frames hold the engine
                else:
                    self._failed_sessions.add(sid)
                    self._to_loop(mail.DecodeFailed(sid))
                return
            if owned:
                self._to_intake(mail.Decoded(sid, output, frames, (time.perf_counter() - start) * 1000.0, final))

        self._queue.put(decode)

    def snapshot(self, decoding: Decoding, parts: list[Part], write: Callable[[list[Part]], None]) -> None:
        """After the blocks handed over so far are decoded: the session's decoder state joins this rank's parts of
        a snapshot, which `write` hands to the writer."""
        def capture() -> None:
            decoder_part = snapshots.decode_part(self.vae, self.rank, decoding)
            write(parts if decoder_part is None else [*parts, decoder_part])

        self._queue.put(capture)

    def end(self, session_id: str, error: Refusal | None, told: Refusal) -> None:
        """The session this rank owns ended: the intake learns it after the session's last decoded block."""
        def ended() -> None:
            self._failed_sessions.discard(session_id)
            self._to_intake(mail.Ended(session_id, error, told))

        self._queue.put(ended)

    def close(self, timeout_s: float = 60.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        use_threads(self.threads)
        while (task := self._queue.get()) is not None:
            try:
                task()
            except Exception:  # one session's failure must not stop the others
                log.exception("decoding a block failed")
