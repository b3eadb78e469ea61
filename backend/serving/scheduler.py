"""Rank 0's decisions for the whole group: admission, limits, fair round-robin batches of sessions.

Pure logic on plain data, so every rank can apply the same `Plan` in the same order.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from ..api.request import Controls, SessionRequest
from ..engine.rollout import BlockControls
from .config import ServingConfig


@dataclass
class Submission:
    """A request as it travels from the rank that received it to rank 0 and back to every rank."""

    session_id: str  # "r{rank that holds the response sender}-{n}": unique in the group
    request: SessionRequest
    block_shape: tuple[int, int]  # VideoGeometry.block_shape: sessions that share it can share a forward
    owner: int = 0  # the rank that holds the response sender


@dataclass
class StepEvent:
    """A steered session's next camera (or its end), from the rank that owns the session."""

    session_id: str
    controls: Controls | None
    end: bool = False


@dataclass
class RankEvents:
    """What one rank tells rank 0 at a block boundary."""

    submissions: list[Submission] = field(default_factory=list)
    steps: list[StepEvent] = field(default_factory=list)
    expired: list[tuple[str, str]] = field(default_factory=list)  # (session id, why): the owner's limits
    cancelled: list[str] = field(default_factory=list)
    delivered: dict[str, int] = field(default_factory=dict)  # blocks sent to the client, per owned session
    stop: bool = False


@dataclass
class Plan:
    """What every rank does next, in this order."""

    rejects: list[tuple[str, str]] = field(default_factory=list)  # (session id, message)
    cancels: list[str] = field(default_factory=list)
    opens: list[Submission] = field(default_factory=list)
    batch: list[str] = field(default_factory=list)  # sessions that run their next block together
    controls: dict[str, BlockControls] = field(default_factory=dict)  # the steered sessions' of the batch
    ends: list[str] = field(default_factory=list)  # steered sessions their client ended (no block left)
    expired: list[tuple[str, str]] = field(default_factory=list)  # (session id, why the server ended it)
    stop: bool = False

    @property
    def idle(self) -> bool:
        return not (self.opens or self.batch)


@dataclass
class Steering:
    """The planner's view of a steered session: the cameras it was sent and has not run yet."""

    on_starve: str
    queue: deque[Controls] = field(default_factory=deque)
    requests: int = 1  # requests that want a block (the first one included)
    ending: bool = False


class Scheduler:
    def __init__(self, limits: ServingConfig) -> None:
        self.limits = limits
        self.steering: dict[str, Steering] = {}
        self.pending: deque[Submission] = deque()
        self.active: OrderedDict[str, tuple[int, int]] = OrderedDict()  # round-robin order
        self.computed: dict[str, int] = {}  # blocks run, per active session
        self.delivered: dict[str, int] = {}  # blocks sent, as the owners last reported

    def plan(self, events: list[RankEvents]) -> Plan:
        plan = Plan(stop=any(e.stop for e in events))
        if plan.stop:
            return plan
        cancelled = {sid for e in events for sid in e.cancelled}
        for e in events:
            self.delivered.update({sid: n for sid, n in e.delivered.items() if sid in self.active})
        for sid in cancelled:
            if sid in self.active:
                self.finished(sid)
                plan.cancels.append(sid)
            elif any(p.session_id == sid for p in self.pending):
                self.pending = deque(p for p in self.pending if p.session_id != sid)
                self.steering.pop(sid, None)
                plan.cancels.append(sid)
        new = [s for e in events for s in e.submissions]
        for sub in new:  # steps may arrive with their session's first request, before it has a slot
            if sub.request.steered:
                self.steering[sub.session_id] = Steering(sub.request.on_starve, deque([sub.request.first_controls]))
        self._steps([step for e in events for step in e.steps], plan)
        self._expire([x for e in events for x in e.expired], plan)
        plan.batch = self._next_batch(plan)  # only sessions opened in earlier rounds
        while self.pending and self._has_slot():
            plan.opens.append(self._open(self.pending.popleft()))
        for sub in new:
            if sub.session_id in cancelled:
                self.steering.pop(sub.session_id, None)
                plan.cancels.append(sub.session_id)
            elif self._has_slot():
                plan.opens.append(self._open(sub))
            elif len(self.pending) < self.limits.max_queue:
                self.pending.append(sub)
            else:
                self.steering.pop(sub.session_id, None)
                plan.rejects.append((sub.session_id, self._queue_full()))
        return plan

    def _has_slot(self) -> bool:
        return len(self.active) < self.limits.max_sessions

    def _open(self, sub: Submission) -> Submission:
        self.active[sub.session_id] = sub.block_shape
        self.computed[sub.session_id] = 0
        return sub

    def _steps(self, steps: list[StepEvent], plan: Plan) -> None:
        for step in steps:
            steer = self.steering.get(step.session_id)
            if steer is None:  # ended meanwhile: its owner answers the step
                continue
            if step.controls is not None:
                steer.queue.append(step.controls)
                steer.requests += 1
            steer.ending = steer.ending or step.end
            if steer.ending and not steer.queue:
                self.finished(step.session_id)
                self.pending = deque(p for p in self.pending if p.session_id != step.session_id)
                plan.ends.append(step.session_id)

    def _expire(self, expired: list[tuple[str, str]], plan: Plan) -> None:
        """Steered sessions their owner found idle or too long: ended with the owner's reason."""
        for sid, reason in expired:
            if sid in self.active:
                self.finished(sid)
                plan.expired.append((sid, reason))

    def finished(self, session_id: str) -> None:
        """A session ended (last block, failed open, cancelled): free its slot."""
        self.active.pop(session_id, None)
        self.computed.pop(session_id, None)
        self.delivered.pop(session_id, None)
        self.steering.pop(session_id, None)

    def _next_batch(self, plan: Plan) -> list[str]:
        # Backpressure: a session whose client is max_blocks_ahead blocks behind waits for its writer.
        ready = [
            (sid, key) for sid, key in self.active.items()
            if self.computed[sid] - self.delivered.get(sid, 0) < self.limits.max_blocks_ahead and self._has_camera(sid)
        ]
        if not ready:
            return []
        key = ready[0][1]  # the longest-waiting ready session picks the geometry
        batch = [sid for sid, k in ready if k == key][: self.limits.max_batch]
        for sid in batch:  # served sessions go to the back: fair round robin
            self.active.move_to_end(sid)
            self.computed[sid] += 1
            if (steer := self.steering.get(sid)) is not None:
                controls = steer.queue.popleft() if steer.queue else None  # None: hold the last motion
                plan.controls[sid] = BlockControls(controls, last=steer.ending and not steer.queue)
        return batch

    def _has_camera(self, sid: str) -> bool:
        """A steered session runs a block only with its camera, or, on_starve=hold, on its last motion when
        every request so far has its block (at most one block beyond what the client asked for)."""
        steer = self.steering.get(sid)
        if steer is None or steer.queue:
            return True
        return steer.on_starve == "hold" and not steer.ending and self.computed[sid] == steer.requests

    def _queue_full(self) -> str:
        return (
            f"server busy: {len(self.pending)} sessions already wait for a slot (max_queue={self.limits.max_queue}, "
            f"max_sessions={self.limits.max_sessions}); retry later"
        )
