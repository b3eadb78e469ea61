"""The worlds a rank owns that park off their slot (docs/serving.md, "Parking"), from the decision to their return:
one ledger on the owner's intake thread, which owns the park tier's store in host memory beside the snapshot store.

A park moves one way:

    due      its steered world, on its slot, has asked for no block for park_after_s
    saving   its copy is reserved (in host memory first, in the snapshot store on disk when that is full) and saved
             where the world stands, as any snapshot is (serving/saves, Purpose.PARK); the world keeps its slot
    parked   the copy is durable: the group frees the world's slot and caches (news.Parked); its stream stays open
    back     a step asked for a block and the group opened the world from its copy on a slot (mail.Opened): the
             copy is released

or it is dropped, its copy released and the world left on its slot: a step asked for a block before the copy was
durable, the group refused it (max_parked), or the copy could not be reserved or written (the world parks again
park_after_s later). A parked world that ends (its client left, its idle limit, its end flag) has its copy released
with it; a drain moves it from its copy, and a copy on disk is itself the snapshot MOVED names (its client's from
then on, never released here).
"""
from __future__ import annotations

import enum
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..api.errors import InputError
from ..api.refusal import Refusal
from ..engine.snapshot.manifest import SnapshotError
from ..engine.snapshot.store import SnapshotStore
from . import news
from .saves import Outcome, Purpose, Saves
from .sessions import OwnerPart, Tier
from .settings import ServingSettings

log = logging.getLogger(__name__)


class Stage(enum.Enum):
    SAVING = "saving"  # its copy is being saved; the world keeps its slot
    PARKED = "parked"  # its copy is durable: off its slot, or asked back and not opened yet


@dataclass
class Park:
    snapshot_id: str
    tier: Tier
    store: SnapshotStore
    started_s: float  # when it was decided: its park time runs to its copy's durability
    stage: Stage = Stage.SAVING
    void: bool = False  # the world asked for a block (or a drain moves it) before its copy was durable: dropped then
    nbytes: int = 0  # its copy's, once durable
    given: bool = False  # named to its client in MOVED: the client's snapshot now, never released here


class Parks:
    def __init__(self, rank: int, settings: ServingSettings, saves: Saves, memory: SnapshotStore | None,
                 on_park: Callable[[str, str, float], None] | None = None,
                 on_bytes: Callable[[int, int], None] | None = None) -> None:
        """saves: the rank's save ledger (its store is the disk tier); memory: the park tier's store in host memory
        (None: none); on_park: told (the session, "parked", the seconds from the decision to the copy's durability),
        or "refused" (the group held max_parked) or "failed" (no room, or the copy not written), with 0; on_bytes: the
        bytes this rank's parked worlds hold in memory and on disk, whenever they change (the metrics)."""
        self.rank, self.settings, self.saves = rank, settings, saves
        self.tiers = [(tier, store) for tier, store in ((Tier.MEMORY, memory), (Tier.DISK, saves.store))
                      if store is not None and settings.park_after_s > 0]
        self.on_park, self.on_bytes = on_park, on_bytes
        self._parks: dict[str, Park] = {}  # by session id
        self._retry: dict[str, float] = {}  # a session whose park failed: not before (monotonic seconds)

    def next_due(self, sid: str, part: OwnerPart) -> float:
        """When the session's world parks, as it stands now (monotonic seconds; inf: not while it stands so): a
        steered world on its slot, not ending, whose requests asked for no block for park_after_s."""
        if not self.tiers or sid in self._parks or not part.steered or not part.opened or part.ending is not None \
                or part.cancel_told or part.expiry_told:
            return math.inf
        idle = part.stream.asks_no_block_since()
        return math.inf if idle is None else max(idle + self.settings.park_after_s, self._retry.get(sid, 0.0))

    def next_due_of(self, parts: dict[str, OwnerPart]) -> float:
        """When the first of the owner's sessions parks, as they stand now (monotonic seconds; inf: none)."""
        return min((self.next_due(sid, part) for sid, part in parts.items()), default=math.inf)

    def start_due(self, parts: dict[str, OwnerPart], now: float) -> list[news.Park]:
        """The owner's clock parks each steered world that asks for no block (by `now`): its copy reserved, the news
        that has the group save it where it stands."""
        due = [(sid, part) for sid, part in parts.items() if self.next_due(sid, part) <= now]
        return [news.Park(sid, park.snapshot_id, park.tier) for sid, part in due
                if (park := self._start(sid, part)) is not None]

    def _start(self, sid: str, part: OwnerPart) -> Park | None:
        """The world's copy reserved, in memory first: the park under way (None: no tier has room; logged, and the
        world stays on its slot until it is due again)."""
        refusals: list[Refusal] = []
        for tier, store in self.tiers:
            try:
                snapshot_id = self.saves.reserve(sid, part.request, part.geometry, Purpose.PARK, who=part.principal,
                                                   store=store)
            except (InputError, SnapshotError) as exc:
                refusals.append(exc.refusal)
                continue
            park = self._parks[sid] = Park(snapshot_id, tier, store, time.monotonic())
            return park
        log.warning("rank %d: session %s cannot be parked, it stays on its slot: %s", self.rank, sid,
                    "; ".join(str(r) for r in refusals))
        self._failed(sid, "failed")
        return None

    def of(self, sid: str) -> Park | None:
        return self._parks.get(sid)

    def asked(self, sid: str) -> None:
        """A step of the session asks for a block: a park under way is dropped once its copy is over (a parked
        world comes back through the group's queue)."""
        if (park := self._parks.get(sid)) is not None and park.stage is Stage.SAVING:
            park.void = True

    def saved(self, outcome: Outcome, ended: bool) -> str | None:
        """A park's copy is over: its manifest's text when the group is to take the world off its slot (news.Parked);
        None when it is dropped (released: the world asked for a block meanwhile, or ended; or it failed)."""
        park = self._parks.get(outcome.session_id)
        if park is None or park.snapshot_id != outcome.snapshot_id:
            return None
        if outcome.error is not None:
            if not park.void:
                log.warning("rank %d: parking session %s failed, it stays on its slot: %s", self.rank,
                            outcome.session_id, outcome.error)
                self._failed(outcome.session_id, "failed")
            del self._parks[outcome.session_id]
            return None
        park.stage, park.nbytes = Stage.PARKED, outcome.nbytes
        if park.void or ended:
            self._release(outcome.session_id)
            return None
        if self.on_park is not None:
            self.on_park(outcome.session_id, "parked", time.monotonic() - park.started_s)
        self._tell_bytes()
        log.info("rank %d: session %s parked in %s (%d bytes)", self.rank, outcome.session_id, park.tier.value,
                 park.nbytes)
        return outcome.manifest

    def refused(self, snapshot_id: str, why: Refusal | None) -> Outcome | None:
        """The group would not park the world (why: past max_parked; None: it is not idle): a copy being saved is
        dropped (the save's outcome, for the intake), a durable one released."""
        sid = next((s for s, p in self._parks.items() if p.snapshot_id == snapshot_id), None)
        if sid is None:
            return None
        park = self._parks[sid]
        if why is not None:
            log.warning("rank %d: session %s was not parked, it stays on its slot: %s", self.rank, sid, why)
            self._failed(sid, "refused")
        park.void = True
        if park.stage is Stage.SAVING:
            return self.saves.unsaved(snapshot_id)
        self._release(sid)
        return None

    def back(self, sid: str) -> None:
        """The world is open on a slot again (every rank read its copy): the copy is released."""
        if (park := self._parks.get(sid)) is not None and park.stage is Stage.PARKED:
            self._release(sid)

    def moved_from(self, sid: str) -> str | None:
        """A drain moves the world: the snapshot its MOVED may name at once (a parked world's copy on disk, which
        becomes its client's); None: the drain saves or copies it into a new one (a park under way is dropped)."""
        park = self._parks.get(sid)
        if park is None:
            return None
        if park.stage is Stage.SAVING:
            park.void = True
            return None
        if park.tier is Tier.DISK:
            park.given = True
            return park.snapshot_id
        return None

    def forget(self, sid: str) -> None:
        """The session ended: its copy is released (unless MOVED named it). Its saves are all over by now."""
        self._retry.pop(sid, None)
        if sid in self._parks:
            self._release(sid)

    def _release(self, sid: str) -> None:
        park = self._parks.pop(sid)
        if not park.given:
            park.store.release(park.snapshot_id)
        if park.nbytes:
            self._tell_bytes()

    def _failed(self, sid: str, event: str) -> None:
        self._retry[sid] = time.monotonic() + self.settings.park_after_s
        if self.on_park is not None:
            self.on_park(sid, event, 0.0)

    def _tell_bytes(self) -> None:
        if self.on_bytes is None:
            return
        held = {tier: sum(p.nbytes for p in self._parks.values() if p.tier is tier and not p.given) for tier in Tier}
        self.on_bytes(held[Tier.MEMORY], held[Tier.DISK])
