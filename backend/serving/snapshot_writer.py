"""Each rank's snapshot writer: writes its parts of a saved world into the snapshot's staging folder in the
background, so a save holds the group only for the copy at the block boundary (docs/worlds.md), and reports its
files as news for the snapshot's owner, whose intake publishes the snapshot once every rank's are in
(serving/saves)."""
from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from pathlib import Path

from ..engine.snapshot.files import Part, write_part
from ..engine.snapshot.store import staging_folder
from . import messages
from .news import FilesWritten

log = logging.getLogger(__name__)


class SnapshotWriter:
    def __init__(self, root: Path, rank: int, to_loop: Callable[[FilesWritten], None]) -> None:
        """root: the snapshot store's folder (snapshot_dir); to_loop: the group loop's post (its report is news)."""
        self.root, self.rank, self._to_loop = Path(root), rank, to_loop
        self._queue: queue.SimpleQueue[tuple[str, int, list[Part]] | None] = queue.SimpleQueue()  # None: stop
        self._thread = threading.Thread(target=self._run, name="lingbot-snapshot-writer", daemon=True)
        self._thread.start()

    def write(self, snapshot_id: str, owner: int, parts: list[Part]) -> None:
        """This rank's parts of a snapshot of a session `owner` answers (the decode thread hands them over, after
        the block's decode)."""
        self._queue.put((snapshot_id, owner, parts))

    def close(self, timeout_s: float = 60.0) -> None:
        """Write what is queued, then end."""
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while (task := self._queue.get()) is not None:
            self._to_loop(self._write(*task))

    def _write(self, snapshot_id: str, owner: int, parts: list[Part]) -> FilesWritten:
        try:
            folder = staging_folder(self.root, snapshot_id)
            files = tuple(write_part(folder, part) for part in parts)
        except Exception as exc:  # noqa: BLE001 - a disk's fault: the save fails, the session goes on
            log.error("rank %d: writing snapshot %s failed: %r", self.rank, snapshot_id, exc)
            return FilesWritten(snapshot_id, owner, self.rank, (), messages.save_failed(snapshot_id))
        return FilesWritten(snapshot_id, owner, self.rank, files)
