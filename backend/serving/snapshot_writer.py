"""Each rank's snapshot writer: writes its parts of a saved world into the snapshot's staging folder in the
background, so a save holds the group only for the copy at the block boundary (docs/worlds.md), and reports its
files as news for the snapshot's owner, whose intake publishes the snapshot once every rank's are in
(serving/saves). A parked world moved by a drain has its files copied from its park copy the same way."""
from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from pathlib import Path

from ..engine.snapshot.files import Part, copy_file, write_part
from ..engine.snapshot.manifest import FileEntry
from ..engine.snapshot.store import staging_folder
from . import messages
from .news import FilesWritten

log = logging.getLogger(__name__)


class SnapshotWriter:
    def __init__(self, rank: int, to_loop: Callable[[FilesWritten], None]) -> None:
        """to_loop: the group loop's post (its report is news)."""
        self.rank, self._to_loop = rank, to_loop
        self._queue: queue.SimpleQueue[tuple[Path, str, int, Callable[[Path], list[FileEntry]]] | None] = \
            queue.SimpleQueue()  # None: stop
        self._thread = threading.Thread(target=self._run, name="lingbot-snapshot-writer", daemon=True)
        self._thread.start()

    def write(self, root: Path, snapshot_id: str, owner: int, parts: list[Part]) -> None:
        """This rank's parts of a snapshot in store `root` of a session `owner` answers (the decode thread hands them
        over, after the block's decode)."""
        self._queue.put((root, snapshot_id, owner, lambda folder: [write_part(folder, part) for part in parts]))

    def copy(self, root: Path, snapshot_id: str, owner: int, source: Path, entries: list[FileEntry]) -> None:
        """This rank's files of a parked world's copy (folder `source`) into a snapshot in store `root`."""
        self._queue.put((root, snapshot_id, owner, lambda folder: [copy_file(source, folder, e) for e in entries]))

    def close(self, timeout_s: float = 60.0) -> None:
        """Write what is queued, then end."""
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while (task := self._queue.get()) is not None:
            self._to_loop(self._write(*task))

    def _write(self, root: Path, snapshot_id: str, owner: int,
               write: Callable[[Path], list[FileEntry]]) -> FilesWritten:
        try:
            files = tuple(write(staging_folder(root, snapshot_id)))
        except Exception as exc:  # noqa: BLE001 - a disk's fault: the save fails, the session goes on
            log.error("rank %d: writing snapshot %s failed: %r", self.rank, snapshot_id, exc)
            return FilesWritten(snapshot_id, owner, self.rank, (), messages.save_failed(snapshot_id))
        return FilesWritten(snapshot_id, owner, self.rank, files)
