"""One record per session: the part every rank plans over, and the part only its owning rank holds.

`SharedSession` is identical on every rank: it travels in the events of a block boundary and changes only in
`Scheduler.plan`, which every rank runs on the same events. `OwnerPart` (the stream that answers the client,
the sequence key, the clocks of a steered session's limits) exists on the owning rank only.
"""
from __future__ import annotations

import enum
import time
from collections import deque
from dataclasses import dataclass, field

from ..api.request import Controls, SessionRequest
from ..engine.session import Session
from . import messages
from .config import ServingConfig
from .streams import OwnerStream


class State(enum.Enum):
    PENDING = "pending"  # waiting for a slot
    ACTIVE = "active"  # has a slot and blocks left
    ENDING = "ending"  # steered: its client sent the end flag; its queued steps still run (a slot first, if it waits)
    DONE = "done"  # ended: no slot, no caches


@dataclass
class SharedSession:
    """What every rank's scheduler copy plans over (the same values on every rank)."""

    id: str  # "r{owner}-{n}": unique in the group
    request: SessionRequest
    block_shape: tuple[int, int]  # VideoGeometry.block_shape: sessions that share it can share a forward
    owner: int = 0  # the rank that answers the client
    state: State = State.PENDING
    admitted: bool = False  # holds a slot (generating)
    computed: int = 0  # blocks planned
    delivered: int = 0  # blocks sent to the client, as the owner last reported
    steps: deque[Controls] = field(default_factory=deque)  # steered: cameras received, not run yet
    requests: int = 1  # steered: requests that want a block (the first one included)

    @classmethod
    def submitted(cls, id: str, request: SessionRequest, block_shape: tuple[int, int], owner: int) -> SharedSession:
        """A new session as its owner shares it (a steered one with its first block's camera)."""
        steps = deque([request.first_controls]) if request.steered else deque()
        return cls(id, request, block_shape, owner, steps=steps)

    @property
    def steered(self) -> bool:
        return self.request.steered

    @property
    def live(self) -> bool:
        """Holds a slot and has blocks left."""
        return self.admitted and self.state is not State.DONE

    def lags(self, max_blocks_ahead: int) -> bool:
        """Whether its client is too far behind for another block (backpressure)."""
        return self.computed - self.delivered >= max_blocks_ahead

    def has_camera(self) -> bool:
        """A steered session runs a block only with its camera, or, on_starve=hold, on its last motion when
        every request so far has its block (at most one block beyond what the client asked for)."""
        if not self.steered or self.steps:
            return True
        return self.request.on_starve == "hold" and self.state is not State.ENDING and self.computed == self.requests


@dataclass
class OwnerPart:
    """Only on the rank that received the session's request."""

    stream: OwnerStream
    key: str | None  # steered: the Triton sequence that carries it
    started_s: float = field(default_factory=time.monotonic)

    def deadline(self, settings: ServingConfig) -> float:
        """When a steered session is ended for its idle or lifetime limit (monotonic seconds). The idle clock
        runs only while the server waits on the client (every request answered)."""
        lifetime = self.started_s + settings.max_session_s
        waiting = self.stream.waits_on_client_since()
        return lifetime if waiting is None else min(lifetime, waiting + settings.session_idle_timeout_s)

    def expiry(self, settings: ServingConfig, now: float) -> str | None:
        """Why the session must end now, or None."""
        if now - self.started_s >= settings.max_session_s:
            return messages.session_too_long(settings.max_session_s)
        waiting = self.stream.waits_on_client_since()
        if waiting is not None and now - waiting >= settings.session_idle_timeout_s:
            return messages.session_idle(settings.session_idle_timeout_s)
        return None


@dataclass
class SessionRecord:
    """A session as this rank knows it."""

    shared: SharedSession  # the scheduler's copy once planned
    owner: OwnerPart | None = None  # on the owning rank only
    engine: Session | None = None  # this rank's engine session (caches), while open
    why: str | None = None  # once done: why, for a step that comes late

    @property
    def id(self) -> str:
        return self.shared.id

    @property
    def state(self) -> State:
        return self.shared.state

    @property
    def steered_key(self) -> str | None:
        return self.owner.key if self.owner is not None else None
