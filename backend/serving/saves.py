"""The saves of the sessions a rank owns, from the reservation to the client's answer: one ledger, on the owner's
intake thread, which also owns the rank's one SnapshotStore (docs/worlds.md; a save's hops: docs/serving.md).

A save moves one way:

    reserved   the owner's admission reserved its bytes in the store (a step that asks for it, a start's first block,
               a drain's move of the session, or a park's copy, in the park tier's store or this one): its id is
               known on this rank alone
    written    every rank's files are in: each rank copied its parts at the block boundary after its block, its
               decode thread added the decoder's, its writer wrote them and reported as news (FilesWritten), which the
               owner's group loop hands on here
    published  the manifest written, the staging folder renamed to the id: durable, and only now named to anyone
    told       the outcome handed back to the intake (`Outcome`): a notice on the session's stream, or its MOVED
    released   the older snapshot it names (the world's periodic saves) deleted, once it is published

or it is dropped: a rank could not write its files, publishing failed, or its block never ran (its session ended
first); its staging folder is removed and its client told SNAPSHOT_SAVE_FAILED (a move: that it only ends).
"""
from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from ..api.errors import InputError
from ..api.refusal import Refusal
from ..engine.geometry import VideoGeometry
from ..engine.snapshot.manifest import SnapshotError
from ..engine.snapshot.sessions import SnapshotFacts
from ..engine.snapshot.store import Ownership, SnapshotStore, not_yours
from ..api.request import SessionRequest
from . import messages
from .keys import ANONYMOUS, Principal
from .news import FilesWritten

log = logging.getLogger(__name__)


class Purpose(enum.Enum):
    ASKED = "asked"  # its client asked for it (request parameter save): told in a notice
    MOVE = "move"  # a drain's: the session ends MOVED naming it
    PARK = "park"  # a parked world's copy (serving/parks): never named to its client unless a drain moves it


@dataclass
class Save:
    snapshot_id: str
    session_id: str
    purpose: Purpose
    latent_rows: int  # the session's, for the manifest
    store: SnapshotStore  # where it is reserved (a park's may be the park tier's, in host memory)
    release: str = ""  # an older snapshot of the world to delete once this one is published ("": none)
    reports: dict[int, FilesWritten] = field(default_factory=dict)  # every rank's files, by rank


@dataclass(frozen=True)
class Outcome:
    """A save that is over: published (error None: its manifest's text and bytes) or dropped."""

    session_id: str
    snapshot_id: str
    purpose: Purpose
    error: Refusal | None = None
    manifest: str = ""
    nbytes: int = 0


class Saves:
    def __init__(self, store: SnapshotStore | None, facts: SnapshotFacts | None, ranks: int, keep_commits: bool,
                 on_outcome: Callable[[str], None] | None = None) -> None:
        """store: the rank's snapshot store (None: snapshot_dir is not set, so every save is refused); facts: what
        a snapshot's size and manifest depend on; ranks: the group's, whose files every save waits for;
        keep_commits: sessions keep their commit records (a sliding window), which a snapshot holds;
        on_outcome: told "saved" or "failed" for each save that ran (the metrics)."""
        self.store, self.facts, self.ranks, self.keep_commits = store, facts, ranks, keep_commits
        self.on_outcome = on_outcome
        self._saves: dict[str, Save] = {}  # reserved and not over, by snapshot id

    def reserve(self, session_id: str, request: SessionRequest, geometry: VideoGeometry, purpose: Purpose,
                release: str = "", who: Principal = ANONYMOUS, share: bool = False,
                store: SnapshotStore | None = None) -> str:
        """A new save's id, its bytes reserved in `store` (None: the rank's snapshot store): the session's largest
        snapshot (its window full), owned by the session's key `who`. Refused at once, nothing written: SnapshotError
        SNAPSHOT_STORE_FULL or, past the key's snapshot_bytes, SNAPSHOT_KEY_FULL (with its retry time; a drain's move
        is the operator's, held to the store's quota alone), SNAPSHOT_NOT_YOURS when `release` is another key's,
        InputError without a store."""
        store = store or self.store
        if store is None:
            raise InputError(messages.NO_SNAPSHOT_DIR.sentence)
        if release and not self._may_release(release, who):
            raise not_yours(release, "only its owner releases it")
        size = self.facts.snapshot_size(request, geometry, self.facts.most_blocks(request, geometry), self.keep_commits)
        quota = who.quota.snapshot_bytes if purpose is Purpose.ASKED else None
        snapshot_id = store.reserve(size.total, Ownership(who.digest, share), quota)
        self._saves[snapshot_id] = Save(snapshot_id, session_id, purpose, geometry.latent_height, store, release)
        return snapshot_id

    def _may_release(self, snapshot_id: str, who: Principal) -> bool:
        """Whether `who` owns the snapshot a save releases (one that is gone already releases nothing)."""
        try:
            return self.store.ownership(snapshot_id).owned_by(who.digest)
        except SnapshotError:
            return True

    def pending(self, session_id: str) -> bool:
        """Whether a save of the session is not over yet (its end waits for it: no id before it is durable)."""
        return any(s.session_id == session_id for s in self._saves.values())

    def written(self, report: FilesWritten) -> Outcome | None:
        """A rank's files of a save: once every rank's are in, it is published (or dropped, when one failed)."""
        save = self._saves.get(report.snapshot_id)
        if save is None:
            return None
        save.reports[report.rank] = report
        if len(save.reports) < self.ranks:
            return None
        failed = next((r.error for r in save.reports.values() if r.error is not None), None)
        if failed is not None:
            return self._over(save, failed)
        files = [f for r in sorted(save.reports.values(), key=lambda r: r.rank) for f in r.files]
        manifest = self.facts.manifest(save.snapshot_id, save.latent_rows, files)
        try:
            nbytes = save.store.publish(save.snapshot_id, manifest)
        except (SnapshotError, OSError) as exc:
            log.error("publishing snapshot %s failed: %r", save.snapshot_id, exc)
            return self._over(save, messages.save_failed(save.snapshot_id))
        log.info("snapshot %s of session %s published (%s): %d bytes", save.snapshot_id, save.session_id,
                 save.purpose.value, nbytes)
        if save.release and save.store.release(save.release):
            log.info("snapshot %s released by a newer save of its world", save.release)
        return self._over(save, None, manifest.to_text(), nbytes)

    def unsaved(self, snapshot_id: str) -> Outcome | None:
        """A save whose block never runs (its session ended first): dropped."""
        save = self._saves.get(snapshot_id)
        if save is None:
            return None
        return self._over(save, messages.DRAINING if save.purpose is Purpose.MOVE else messages.not_saved(snapshot_id))

    def _over(self, save: Save, error: Refusal | None, manifest: str = "", nbytes: int = 0) -> Outcome:
        del self._saves[save.snapshot_id]
        if error is not None:
            save.store.abandon(save.snapshot_id)
        # A move never made is no save; a park's copy counts as a park (serving/parks).
        if self.on_outcome is not None and error is not messages.DRAINING and save.purpose is not Purpose.PARK:
            self.on_outcome("saved" if error is None else "failed")
        return Outcome(save.session_id, save.snapshot_id, save.purpose, error, manifest, nbytes)
