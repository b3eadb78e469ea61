"""Each rank's snapshot writer: writes its parts of a saved world in the background, so a save holds the group only
for the copy at the block boundary (docs/worlds.md). It reports each snapshot's files to the group loop (news for
the snapshot's owner), and on the owner publishes the snapshot once every rank's files are in, then tells the
intake."""
from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from ..api.refusal import Refusal
from ..engine.snapshot.files import Part, write_part
from ..engine.snapshot.manifest import Manifest, SnapshotError
from ..engine.snapshot.store import SnapshotStore
from . import mail, messages

log = logging.getLogger(__name__)


class SnapshotWriter:
    def __init__(self, store: SnapshotStore, rank: int, to_loop: Callable[[mail.LoopLetter], None],
                 to_intake: Callable[[mail.IntakeLetter], None],
                 on_published: Callable[[str], None] | None = None) -> None:
        """on_published: told "saved" or "failed" for each snapshot this rank (its owner) publishes or drops."""
        self.store, self.rank = store, rank
        self._to_loop, self._to_intake, self._on_published = to_loop, to_intake, on_published
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()  # None stops the thread
        self._thread = threading.Thread(target=self._run, name="lingbot-snapshot-writer", daemon=True)
        self._thread.start()

    def write(self, snapshot_id: str, parts: list[Part]) -> None:
        """This rank's parts of a snapshot (the decode thread hands them over, after the block's decode)."""
        self._queue.put(lambda: self._write(snapshot_id, parts))

    def publish(self, session_id: str, snapshot_id: str, manifest: Manifest | None, error: Refusal | None) -> None:
        """On the owner, once every rank reported: publish the snapshot (or drop it, when a rank failed) and tell
        the intake."""
        self._queue.put(lambda: self._publish(session_id, snapshot_id, manifest, error))

    def close(self, timeout_s: float = 60.0) -> None:
        """Write and publish what is queued, then end."""
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while (task := self._queue.get()) is not None:
            try:
                task()
            except Exception:  # one snapshot's failure must not stop the others
                log.exception("rank %d: a snapshot task failed", self.rank)

    def _write(self, snapshot_id: str, parts: list[Part]) -> None:
        try:
            folder = self.store.staging(snapshot_id)
            files = tuple(write_part(folder, part) for part in parts)
        except Exception as exc:  # noqa: BLE001 - a disk's fault: the save fails, the session goes on
            log.error("rank %d: writing snapshot %s failed: %r", self.rank, snapshot_id, exc)
            self._to_loop(mail.SnapshotWritten(snapshot_id, self.rank, (), messages.save_failed(snapshot_id)))
            return
        self._to_loop(mail.SnapshotWritten(snapshot_id, self.rank, files))

    def _publish(self, session_id: str, snapshot_id: str, manifest: Manifest | None, error: Refusal | None) -> None:
        if manifest is not None:
            try:
                nbytes = self.store.publish(snapshot_id, manifest)
                log.info("snapshot %s of session %s published: %d bytes", snapshot_id, session_id, nbytes)
            except (SnapshotError, OSError) as exc:
                log.error("publishing snapshot %s failed: %r", snapshot_id, exc)
                error = messages.save_failed(snapshot_id)
        if error is not None:
            self.store.abandon(snapshot_id)
        if self._on_published is not None and error is not messages.DRAINING:  # a move never made is no save
            self._on_published("saved" if error is None else "failed")
        self._to_intake(mail.Saved(session_id, snapshot_id, error))
