"""A played world's save schedule: which step carries a save, and each save's outcome (client/world.py, docs/worlds.md
"Saves" and "The interval")."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from backend.api import contract
from backend.api.codec import SnapshotNotice
from backend.api.request import Controls
from client.stream import StreamError


@dataclass(frozen=True)
class Saved:
    """A save's outcome: durable (error None: `snapshot_id` resumes the world after `block_index`), or why not."""

    snapshot_id: str | None  # None: refused at once (the store is full), nothing written
    block_index: int | None  # the block the snapshot follows (None: refused before its block ran)
    asked: bool  # asked for with save(), not a periodic save
    error: str | None = None
    released: str = ""  # durable: the older periodic snapshot it released, deleted from the store ("": none)


@dataclass(eq=False)
class Step:
    """A step sent, its block not come yet (a save rides on one: compared by identity)."""

    controls: Controls  # as the caller sent it (no save flag)


@dataclass
class _Saving:
    step: Step | None  # the step it rides on, until its block came (or its refusal)
    asked: bool
    release: str = ""  # the older periodic snapshot it asks the server to delete once it is durable
    block_index: int | None = None
    snapshot_id: str | None = None
    error: str | None = None


class SaveSchedule:
    """A world's saves: one every `every` blocks (0: only those asked for) and each one asked for, one at a time so
    that an id always names the block it follows. Each periodic save releases the periodic snapshot before the
    world's base once it is durable (a world keeps its base and the one before). A save is settled once its block
    came and its outcome was told; its Saved waits until `tell` hands it to on_snapshot on the caller's thread."""

    def __init__(self, every: int, on_snapshot: Callable[[Saved], None] | None) -> None:
        self.every = every
        self.on_snapshot = on_snapshot
        self._saving: _Saving | None = None  # at most one save at a time
        self._asked = False  # a save asked for, not sent yet
        # This world's periodic snapshots known durable, oldest first: each periodic save releases the one before the
        # base (so the server frees it once the new save is durable, while the base a failover may still need stays).
        self._periodic: list[str] = []
        self._last_block: int | None = -1  # the block the latest save follows, or the base's (None: not known yet)
        self._untold: list[Saved] = []  # outcomes for on_snapshot, told once the caller has the block they follow

    def ask(self) -> None:
        """A save after the block of the next step (or the one after, while another save is under way)."""
        self._asked = True

    @property
    def under_way(self) -> bool:
        """A save was sent and its outcome is not settled."""
        return self._saving is not None

    @property
    def waits_for_block(self) -> bool:
        """A save was sent and its block has not come (nor its refusal)."""
        return self._saving is not None and self._saving.step is not None

    def due(self, block: int) -> bool:
        """Whether the step of `block` (unless a held block comes first) carries a save: one asked for, or `every`
        blocks since the last; none while one is under way or the base's block is not known."""
        if self._saving is not None or self._last_block is None:
            return False
        return self._asked or 0 < self.every <= block - self._last_block

    def send(self, step: Step, block: int) -> str:
        """The save rides on `step`, for `block`: returns the snapshot it releases ("": none)."""
        periodic = not self._asked
        release = self._periodic[-2] if periodic and len(self._periodic) >= 2 else ""
        self._saving = _Saving(step, self._asked, release)
        self._asked = False
        self._last_block = block
        return release

    def refused(self, refusal: StreamError) -> Step:
        """The save's step was refused at once (the store is full, or the server keeps no snapshots: then no more
        saves are asked for), its block not run: returns that step, for the world to send again without it."""
        saving, self._saving = self._saving, None
        if refusal.code != contract.SNAPSHOT_STORE_FULL:
            self.every = 0
        self._untold.append(Saved(None, None, saving.asked, refusal.sentence))
        return saving.step

    def came(self, step: Step, block_index: int) -> Saved | None:
        """A step's block came: the save's it rides on, settled when its outcome was told (returned)."""
        if self._saving is None or self._saving.step is not step:
            return None
        self._saving.step, self._saving.block_index = None, block_index
        return self._settle()

    def told(self, notice: SnapshotNotice) -> Saved | None:
        """The server told a save's outcome: settled when its block came (returned)."""
        saving = self._saving
        if saving is None or saving.snapshot_id is not None:
            return None  # not this session's save (its outcome was told already)
        saving.snapshot_id, saving.error = notice.snapshot_id, notice.error
        return self._settle()

    def _settle(self) -> Saved | None:
        """A save whose block came and whose outcome was told: durable (the world's new base) or failed."""
        saving = self._saving
        if saving.step is not None or saving.snapshot_id is None:
            return None
        self._saving = None
        if saving.error is None and not saving.asked:
            self._periodic = [s for s in self._periodic if s != saving.release] + [saving.snapshot_id]
        released = saving.release if saving.error is None else ""
        saved = Saved(saving.snapshot_id, saving.block_index, saving.asked, saving.error, released)
        self._untold.append(saved)
        return saved

    def based(self, block: int | None) -> None:
        """The world's base follows `block` (-1: none; None: not known yet, and no save until it is), and no save
        has followed it yet."""
        self._last_block = block

    def lost(self, base_block: int | None) -> None:
        """The stream was lost: a save whose outcome was not told is no base (the base follows base_block), and the
        next step saves instead."""
        if (saving := self._saving) is not None:
            self._saving, self._asked = None, self._asked or saving.asked
            self.based(base_block)

    def tell(self) -> None:
        """Hand the outcomes settled since the last `tell` to on_snapshot (the caller's thread)."""
        told, self._untold = self._untold, []
        for saved in told if self.on_snapshot is not None else ():
            self.on_snapshot(saved)
