"""What one rank tells the others at a block boundary (the control plane carries it; every rank's scheduler copy plans
from every rank's news, in rank order). A rank's news is made of its threads' letters (serving/mail) to its group
loop, collected at the boundary."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..api.refusal import Refusal
from ..api.request import Controls
from ..engine.snapshot.manifest import FileEntry
from .sessions import Ending, SharedSession, Tier


@dataclass(frozen=True)
class StepEvent:
    """A steered session's next block (its controls, and the snapshot its owner reserved when the step asks for a
    save), or its end flag alone (controls None), from the rank that owns the session."""

    session_id: str
    controls: Controls | None
    end: bool = False
    snapshot_id: str | None = None


@dataclass(frozen=True)
class FilesWritten:
    """A rank's files of a snapshot are written (or could not be): news for the snapshot's owner, whose intake
    publishes the snapshot once every rank's are in."""

    snapshot_id: str
    owner: int  # the rank of the session's owner, which publishes it
    rank: int
    files: tuple[FileEntry, ...]
    error: Refusal | None = None


@dataclass(frozen=True)
class Park:
    """The owner parks an idle steered world (docs/serving.md, "Parking"): it is saved where it stands into
    `snapshot_id`, reserved in `tier`."""

    session_id: str
    snapshot_id: str
    tier: Tier


@dataclass(frozen=True)
class Parked:
    """A park's copy is over, told however it ended: durable (published; `manifest`: its text), the world leaves its
    slot; dropped (`manifest` None: the world asked for a block meanwhile, or the copy failed), it stays on its slot
    and may park again."""

    session_id: str
    snapshot_id: str
    manifest: str | None


@dataclass
class RankEvents:
    """What one rank tells the others at a block boundary."""

    submissions: list[SharedSession] = field(default_factory=list)  # sessions this rank admitted
    steps: list[StepEvent] = field(default_factory=list)
    expired: list[tuple[str, Refusal]] = field(default_factory=list)  # (session id, why): the owner's limits
    cancelled: list[str] = field(default_factory=list)
    failed: list[tuple[str, Ending]] = field(default_factory=list)  # sessions this rank could not open or decode
    delivered: dict[str, int] = field(default_factory=dict)  # blocks sent to the client, per owned session
    revoked: list[str] = field(default_factory=list)  # tags of keys this rank's keys file no longer holds
    moving: list[tuple[str, str | None]] = field(default_factory=list)  # (session id, its snapshot): the group drains
    written: list[FilesWritten] = field(default_factory=list)  # this rank's files of snapshots, for their owners
    seated: list[str] = field(default_factory=list)  # sessions this rank owns that the fleet's books seated now
    over_quota: list[tuple[str, Refusal]] = field(default_factory=list)  # (session id, why): its key's hour, fleet-wide
    parking: list[Park] = field(default_factory=list)  # idle worlds this rank owns, to be parked
    parked: list[Parked] = field(default_factory=list)  # parks of this rank's worlds whose copy is durable
    stop: bool = False
    clock_s: float = 0.0  # the rank's wall clock (time.time()) as it collected: not news by itself

    def __bool__(self) -> bool:
        return bool(self.submissions or self.steps or self.expired or self.cancelled or self.failed
                    or self.delivered or self.revoked or self.moving or self.written or self.seated or self.over_quota
                    or self.parking or self.parked
                    or self.stop)
