"""Where a group's saved worlds and parked worlds' copies live (docs/worlds.md; docs/serving.md, "Parking"): the
snapshot store's folder and the park tier's in host memory, as each rank's group loop and writer reach them (the
owner's intake holds the stores themselves: their quotas, reservations and publications), and the snapshot a resume
or an unpark opens there."""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from ..engine.snapshot.manifest import Snapshot
from ..engine.snapshot.store import snapshot_at
from .sessions import ResumeFrom, Tier
from .settings import ServingSettings


def park_root(settings: ServingSettings) -> Path | None:
    """The group's park tier in host memory: park_memory_dir, where parking is on, on one host (the folder is each
    host's own; a world's files come from every rank); None: parks go to the snapshot store alone."""
    on = settings.park_after_s > 0 and settings.park_memory_bytes > 0 and settings.host_count == 1
    return Path(settings.park_memory_dir) if on and settings.park_memory_dir else None


def clear_park_tier(settings: ServingSettings) -> None:
    """Empty the park tier a load starts with (what a killed group left: its worlds are gone with it); on rank 0,
    before any rank parks a world."""
    if (root := park_root(settings)) is not None and root.is_dir():
        for path in root.iterdir():
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)


@dataclass(frozen=True)
class Folders:
    snapshots: Path | None  # the snapshot store's (snapshot_dir; None: not set)
    parks: Path | None  # the park tier's in host memory (None: none)

    @classmethod
    def of(cls, settings: ServingSettings) -> Folders:
        return cls(Path(settings.snapshot_dir) if settings.snapshot_dir else None, park_root(settings))

    def root(self, tier: Tier | None) -> Path | None:
        """The folder a snapshot is in: the park tier's for a copy in memory, else the snapshot store's."""
        return self.parks if tier is Tier.MEMORY else self.snapshots

    def opened(self, resume: ResumeFrom) -> Snapshot:
        """The snapshot a session opens from, built from its manifest's text (no disk: store.snapshot_at). A parked
        world's copy in host memory is the server's own: its files' sizes are checked, not their hashes."""
        return snapshot_at(self.root(resume.park), resume.snapshot_id, resume.manifest,
                           check_hashes=resume.park is not Tier.MEMORY)
