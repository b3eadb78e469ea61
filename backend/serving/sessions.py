"""A session's lifecycle and its two parts: what every rank plans over, and what only its owning rank holds.

`SharedSession` is identical on every rank: it travels in the events of a block boundary and changes only in
`Scheduler.plan`, which every rank runs on the same events; its `status` (one of `Status`, moved only along
`TRANSITIONS`, by the scheduler) is the one record of where the session stands, and its payloads (`parking`,
`park_copy`, `resume`, `ending`) are what that status holds. `OwnerPart` (the stream that answers the client, the
sequence id, the clocks of a steered session's limits) exists in the owning rank's intake only (serving/intake); it
never writes the status.
"""
from __future__ import annotations

import enum
import time
from collections import deque
from dataclasses import dataclass, field

from ..api import contract as c
from ..api.refusal import Refusal
from ..api.request import Controls, SessionRequest
from ..engine.geometry import VideoGeometry
from . import messages
from .settings import ServingSettings
from .keys import ANONYMOUS, Principal
from .streams import OwnerStream, Responder


class Status(enum.Enum):
    """Where a session stands, its whole life (docs/serving.md, "A session's lifecycle")."""

    WAITING_SEAT = "waiting for a seat"  # the fleet's books have not seated it: it waits in its key's fleet queue
    WAITING_SLOT = "waiting for a slot"  # in the group's queue (fair between keys)
    RUNNING = "running"  # holds a slot: runs its blocks
    PARKING = "parking"  # holds a slot while its park copy is written (`parking`)
    PARKED = "parked"  # off its slot, its world in its park copy (`park_copy`)
    RETURNING = "returning"  # parked, and a step asks for a block: first in the queue for a slot
    ENDED = "ended"  # out of the table (`ending` says why): no slot, no caches, no copy


# The only moves a status makes (`SharedSession.move`); any status may end.
TRANSITIONS: dict[Status, frozenset[Status]] = {
    Status.WAITING_SEAT: frozenset({Status.WAITING_SLOT, Status.ENDED}),
    Status.WAITING_SLOT: frozenset({Status.RUNNING, Status.ENDED}),
    Status.RUNNING: frozenset({Status.PARKING, Status.ENDED}),
    Status.PARKING: frozenset({Status.RUNNING, Status.PARKED, Status.ENDED}),
    Status.PARKED: frozenset({Status.RETURNING, Status.ENDED}),
    Status.RETURNING: frozenset({Status.RUNNING, Status.ENDED}),
    Status.ENDED: frozenset(),
}
WAITING = frozenset({Status.WAITING_SEAT, Status.WAITING_SLOT})  # new sessions, before their first slot
HOLDS_SLOT = frozenset({Status.RUNNING, Status.PARKING})
IN_PARK = frozenset({Status.PARKED, Status.RETURNING})  # off its slot, its world in its park copy


class TransitionError(RuntimeError):
    """A status asked to move where `TRANSITIONS` does not lead: a scheduler bug, never a client's doing."""


class EndReason(enum.Enum):
    """Why a session ended, as logged and counted (lingbot_world_sessions_ended_total{reason})."""

    FINISHED = "finished"  # its set length ran (a clip's blocks, a steered session's max_blocks)
    ENDED = "ended by its client"  # a steered session's end flag, once the blocks its steps asked for ran
    REJECTED = "rejected"  # the queue was full, or it could not be opened
    FAILED = "failed"  # its own decode failed on its owner
    CANCELLED = "cancelled"  # its client went away
    EXPIRED = "expired"  # the owner's idle or lifetime limit
    MOVED = "moved"  # the group drained: saved, to go on elsewhere
    REVOKED = "revoked"  # the operator revoked its key
    QUOTA = "over its key's quota"  # its key used its blocks_per_hour
    ABORTED = "aborted"  # the group loop ended (unload or failure)


@dataclass(frozen=True)
class Ending:
    reason: EndReason
    error: Refusal | None = None  # what its client is told; None: its stream closes after its blocks

    def told(self) -> Refusal:
        """What a step that comes after the end is told: the ending's own refusal, or that it ended."""
        return self.error or Refusal(c.SESSION_UNKNOWN, f"it {self.reason.value}")


@dataclass(frozen=True)
class Step:
    """A steered session's next block as its group plans it: its controls as its client sent them, and the
    snapshot its owner reserved when it asks for a save after its block."""

    controls: Controls
    snapshot_id: str | None = None


class Tier(enum.Enum):
    """Where a parked world's copy lives (docs/serving.md, "Parking")."""

    MEMORY = "memory"  # the park tier's folder on a tmpfs (park_memory_dir): host memory
    DISK = "disk"  # the snapshot store (snapshot_dir)


@dataclass(frozen=True)
class ResumeFrom:
    """Where a resumed session opens: its snapshot (the manifest's text travels, so no rank but the owner reads the
    store before the collective open), the blocks it had made, and a fork's new noise seed."""

    snapshot_id: str
    manifest: str
    block_index: int
    fork_seed: int | None = None  # None: the saved noise goes on
    park: Tier | None = None  # a parked world's own copy, in this tier (None: a client's snapshot, in the store)


@dataclass(frozen=True)
class Parking:
    """A park under way: the world is saved where it stands into `snapshot_id` (in `tier`) after its `block`-th
    block; it keeps its slot until the copy is durable."""

    snapshot_id: str
    tier: Tier
    block: int


@dataclass
class SharedSession:
    """What every rank's scheduler copy plans over (the same values on every rank): the admitted request and
    what admission resolved (its geometry), and where the session stands."""

    id: str  # "r{owner}-{n}": unique in the group
    request: SessionRequest
    geometry: VideoGeometry  # resolved once, by the owner's admission step; every rank opens the session with it
    owner: int = 0  # the rank that answers the client
    # Where it stands. Its owner gives its first (WAITING_SEAT where the fleet's books have not seated it) as it
    # shares it; from then on only the scheduler moves it (`move`).
    status: Status = Status.WAITING_SLOT
    # Why it ends: set as it ends (ENDED), or before, by its client's end flag (ENDED by its client, its queued steps
    # run first, in whatever status it stands).
    ending: Ending | None = None
    computed: int = 0  # blocks planned
    delivered: int = 0  # blocks sent to the client, as the owner last reported
    steps: deque[Step] = field(default_factory=deque)  # steered: steps received, not run yet
    requests: int = 1  # steered: requests that want a block (the first one included)
    recached: bool = False  # its cache was recomputed at the last boundary: its next block says so
    principal: Principal = ANONYMOUS  # whose key it runs on (its name, never the key), with that key's limits
    resume: ResumeFrom | None = None  # where it opens: a snapshot, or (a returning world given a slot) its park copy
    parking: Parking | None = None  # PARKING: the copy under way
    park_copy: ResumeFrom | None = None  # PARKED, RETURNING: its park copy, where it opens again

    @classmethod
    def submitted(cls, id: str, request: SessionRequest, geometry: VideoGeometry, owner: int,
                  principal: Principal = ANONYMOUS, first: Step | None = None) -> SharedSession:
        """A new session as its owner shares it (a steered one with its first block's step: `first`, by default
        the request's camera)."""
        steps = deque([first or Step(request.first_controls)]) if request.steered else deque()
        return cls(id, request, geometry, owner, steps=steps, principal=principal)

    @classmethod
    def resumed(cls, id: str, request: SessionRequest, geometry: VideoGeometry, owner: int, principal: Principal,
                resume: ResumeFrom, first: Step) -> SharedSession:
        """A session opened from a snapshot: its blocks go on from the snapshot's (its first request asks for the
        next one)."""
        done = resume.block_index
        return cls(id, request, geometry, owner, computed=done, delivered=done, steps=deque([first]),
                   requests=done + 1, principal=principal, resume=resume)

    @property
    def user(self) -> str:
        """Its key's name ("": a server without keys)."""
        return self.principal.name

    @property
    def steered(self) -> bool:
        return self.request.steered

    @property
    def block_shape(self) -> tuple[int, int]:
        """Sessions that share it can share a forward."""
        return self.geometry.block_shape

    @property
    def num_blocks(self) -> int:
        """Its set length: a clip's blocks, a steered session's max_blocks, or 0 (until its client ends it)."""
        return self.request.max_blocks if self.steered else self.geometry.num_blocks

    @property
    def holds_slot(self) -> bool:
        return self.status in HOLDS_SLOT

    @property
    def in_park(self) -> bool:
        return self.status in IN_PARK

    def move(self, status: Status) -> None:
        """Its status moves on along `TRANSITIONS` (the scheduler's call alone), or TransitionError."""
        if status not in TRANSITIONS[self.status]:
            raise TransitionError(f"session {self.id} cannot move from {self.status.name} to {status.name}")
        self.status = status

    def end(self, ending: Ending) -> None:
        """It ends (the scheduler's call alone), why `ending` says; it holds nothing from now on (its owner drops its
        copies as it ends)."""
        self.move(Status.ENDED)
        self.ending, self.parking, self.park_copy = ending, None, None

    def lags(self, max_blocks_ahead: int) -> bool:
        """Whether its client is too far behind for another block (backpressure)."""
        return self.computed - self.delivered >= max_blocks_ahead

    def has_camera(self) -> bool:
        """A steered session runs a block only with its camera, or, on_starve=hold, on its last motion when
        every request so far has its block (at most one block beyond what the client asked for)."""
        if not self.steered or self.steps:
            return True
        return self.request.on_starve == "hold" and self.ending is None and self.computed == self.requests

    def recache_due(self) -> bool:
        """Its next step is a prompt event that asks for its cached frames to be recomputed first."""
        return bool(self.steps) and self.steps[0].controls.recache

    def last_block_planned(self) -> bool:
        """Its set length is planned, or its client ended it and no step is left."""
        return 0 < self.num_blocks <= self.computed or (self.ending is not None and not self.steps)


@dataclass
class OwnerPart:
    """Only in the intake of the rank that received the session's request."""

    stream: OwnerStream
    sequence_id: str | None  # steered: the Triton sequence that carries it
    started_s: float = field(default_factory=time.monotonic)
    principal: Principal = ANONYMOUS  # whose key it runs on, with that key's limits
    leased: bool = False  # it holds a lease in the fleet's books (its key has limits they count): released as it ends
    request: SessionRequest | None = None  # steered: what a save's size is made of
    geometry: VideoGeometry | None = None
    ending: tuple[Refusal | None, Refusal] | None = None  # its end (error, told), held until its saves are told
    move_dropped: bool = False  # the drain's save of it failed: it ends without a snapshot to resume
    late: list[Responder] = field(default_factory=list)  # steps of its sequence after its end, told `told` once its
    # saves are told (a snapshot is named only once durable: serving/saves); a pause then waits on its stream
    opened: bool = False  # it has its slot and caches: its limits' clocks apply
    place: tuple[int, float, float] | None = None  # its place in the queue as last told, its wait, when (monotonic s)
    cancel_told: bool = False  # the group loop was told its client went away
    expiry_told: bool = False  # the group loop was told it reached a limit

    @property
    def steered(self) -> bool:
        return self.sequence_id is not None

    def lifetime_s(self, settings: ServingSettings) -> float:
        """How long it may run: the server's max_session_s, or its key's session_s where that is shorter."""
        return min(settings.max_session_s, self.principal.quota.session_s or settings.max_session_s)

    def deadline(self, settings: ServingSettings) -> float:
        """When a steered session is ended for its idle or lifetime limit (monotonic seconds). The idle clock
        runs only while the server waits on the client (every request answered)."""
        lifetime = self.started_s + self.lifetime_s(settings)
        waiting = self.stream.waits_on_client_since()
        return lifetime if waiting is None else min(lifetime, waiting + settings.session_idle_timeout_s)

    def expiry(self, settings: ServingSettings, now: float) -> Refusal | None:
        """Why the session must end now, or None."""
        if now - self.started_s >= (limit := self.lifetime_s(settings)):
            return messages.session_too_long(limit, by_key=limit < settings.max_session_s)
        waiting = self.stream.waits_on_client_since()
        if waiting is not None and now - waiting >= settings.session_idle_timeout_s:
            return messages.session_idle(settings.session_idle_timeout_s)
        return None
