"""What a rank's threads send each other. Each receiver has one queue (its inbox) and is the only reader of it;
a sender puts a letter in and, when the receiver is the group loop, rings the doorbell.

To the group loop (serving/loop): news of this rank's clients from the intake (its parks too: news/Park,
news/Parked), the decode sender's failures and the snapshot writer's files (news/FilesWritten).
To the intake (serving/intake): what to answer, from the group loop and the decode sender, and the saves of the
sessions it owns (their files written on every rank: news/FilesWritten, handed on by the loop; or never run; a park
the group refused); from the books thread, the fleet's books' answers (a start's lease, and Seated, OverQuota: news
the intake hands on to the group loop).
To the books thread (serving/bookkeeper), from the intake: the leases of its sessions to take, count and release.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..api.refusal import Refusal
from ..api.request import ResumeRequest, SessionRequest, StepRequest
from ..engine.blocks import BlockOutput
from ..engine.snapshot.restore import SharedState
from .keys import ANONYMOUS, Principal
from .news import FilesWritten, Park, Parked, StepEvent
from .sessions import SharedSession
from .streams import Responder

# -- to the group loop ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Submitted:
    """A session this rank admitted (its owner): shared with every rank at the next boundary. A resumed one's
    `saved` is what admission read of its snapshot's shared file, for this rank's opening of it (no other rank's:
    it stays here)."""

    session: SharedSession
    saved: SharedState | None = None


@dataclass(frozen=True)
class Stepped:
    """A steered session's next camera, or its end flag."""

    step: StepEvent


@dataclass(frozen=True)
class Cancelled:
    """The session's client went away."""

    session_id: str


@dataclass(frozen=True)
class Expired:
    """The owner's clock ended a steered session: its idle or lifetime limit."""

    session_id: str
    why: Refusal


@dataclass(frozen=True)
class Delivered:
    """The session's client has received `blocks` blocks in all (backpressure)."""

    session_id: str
    blocks: int


@dataclass(frozen=True)
class DecodeFailed:
    """A decode of this rank's own session failed: the session ends (the group goes on)."""

    session_id: str


@dataclass(frozen=True)
class SharedDecodeFailed:
    """A decode every rank takes part in failed: the ranks' exchanges are out of step, so the group fails."""

    error: str


@dataclass(frozen=True)
class Moving:
    """The group drains: the session is saved at the next boundary into `snapshot_id` (reserved by its owner) and
    ends with MOVED; None: its owner could not reserve one, so it only ends."""

    session_id: str
    snapshot_id: str | None


@dataclass(frozen=True)
class Revoked:
    """The operator's reload of the keys file dropped these keys (their tags): their sessions end."""

    tags: frozenset[str]


@dataclass(frozen=True)
class Seated:
    """The fleet's books seated these sessions this rank owns (they waited in their key's queue): they may hold a
    slot."""

    session_ids: tuple[str, ...]


@dataclass(frozen=True)
class OverQuota:
    """The session's key used its blocks_per_hour across the fleet (the books' count): it ends."""

    session_id: str
    why: Refusal


@dataclass(frozen=True)
class Stop:
    """The model is unloading or the server stopping: every session ends and the loop returns."""


LoopLetter = (Submitted | Stepped | Cancelled | Expired | Delivered | DecodeFailed | SharedDecodeFailed | FilesWritten
              | Moving | Revoked | Seated | OverQuota | Park | Parked | Stop)

# -- to the intake ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Arrived:
    """A request as Triton handed it over: parsed, or refused at its door or parse (`refusal`), with its sequence
    key and whose key it carries."""

    key: str
    request: SessionRequest | ResumeRequest | StepRequest | None
    responder: Responder
    refusal: Refusal | None = None
    principal: Principal = ANONYMOUS


@dataclass(frozen=True)
class Opened:
    """The session has its slot and its caches on every rank: its owner's clocks for its limits run."""

    session_id: str


@dataclass(frozen=True)
class Placed:
    """The session's place in the queue changed (0: it has its slot) with its estimated wait."""

    session_id: str
    place: int
    wait_s: float


@dataclass(frozen=True)
class Decoded:
    """A block of the session, decoded: its client's next response."""

    session_id: str
    output: BlockOutput
    frames: np.ndarray
    decode_ms: float
    final: bool


@dataclass(frozen=True)
class Ended:
    """The session ended (after its decoded blocks): what still waits gets `error`, or closes after its blocks
    (None); a later step of its sequence is told `told`."""

    session_id: str
    error: Refusal | None
    told: Refusal


@dataclass(frozen=True)
class Unsaved:
    """A save of a session this rank owns whose block never runs (the session ended first): its owner drops it."""

    snapshot_id: str


@dataclass(frozen=True)
class ParkRefused:
    """The group would not park a world this rank owns (why: past max_parked; None: it asked for a block again, or
    ended): its owner drops the park's copy, and the world stays on its slot."""

    snapshot_id: str
    why: Refusal | None


@dataclass(frozen=True)
class Drain:
    """The server drains (an operator's restart or move): refuse new sessions, save and move every open one."""


@dataclass(frozen=True)
class Closed:
    """The group loop has ended: every open stream and every later request gets `reason`."""

    reason: Refusal


@dataclass(frozen=True)
class Leased:
    """The fleet's books' answer to a start's lease: seated (it may hold a slot), waiting in its key's queue for a
    seat (Seated comes later), or `refusal` (the key's limits across the fleet, or the books not answering)."""

    session_id: str
    seated: bool
    refusal: Refusal | None = None


IntakeLetter = (Arrived | Opened | Placed | Decoded | Ended | FilesWritten | Unsaved | ParkRefused | Drain | Closed
                | Leased | Seated | OverQuota)

# -- to the books thread ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Lease:
    """A start of a key with limits the books count, admitted: its lease, asked before any work (answered Leased)."""

    session_id: str
    principal: Principal


@dataclass(frozen=True)
class Block:
    """A block reached the session's client: it counts in its key's hour."""

    session_id: str


@dataclass(frozen=True)
class Release:
    """The session ended: its lease goes."""

    session_id: str


BooksLetter = Lease | Block | Release
