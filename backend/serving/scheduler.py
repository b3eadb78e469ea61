"""The group's decisions at a block boundary: admission, limits, steering, fair round-robin batches of sessions.

Pure logic on plain data. Every rank keeps its own copy and plans from the same events (every rank's, in rank
order), so every rank applies the same `Plan` in the same order without a broadcast.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from ..api.request import Controls
from ..engine.blocks import BlockControls
from .config import ServingConfig
from .sessions import SharedSession, State


@dataclass
class StepEvent:
    """A steered session's next camera (or its end), from the rank that owns the session."""

    session_id: str
    controls: Controls | None
    end: bool = False


@dataclass
class RankEvents:
    """What one rank tells the others at a block boundary."""

    submissions: list[SharedSession] = field(default_factory=list)  # sessions this rank received
    steps: list[StepEvent] = field(default_factory=list)
    expired: list[tuple[str, str]] = field(default_factory=list)  # (session id, why): the owner's limits
    cancelled: list[str] = field(default_factory=list)
    delivered: dict[str, int] = field(default_factory=dict)  # blocks sent to the client, per owned session
    stop: bool = False

    def __bool__(self) -> bool:
        return bool(self.submissions or self.steps or self.expired or self.cancelled or self.delivered or self.stop)


@dataclass
class Plan:
    """What every rank does next, in this order."""

    rejects: list[tuple[str, str]] = field(default_factory=list)  # (session id, message)
    cancels: list[str] = field(default_factory=list)
    opens: list[SharedSession] = field(default_factory=list)
    batch: list[str] = field(default_factory=list)  # sessions that run their next block together
    controls: dict[str, BlockControls] = field(default_factory=dict)  # the steered sessions' of the batch
    ends: list[str] = field(default_factory=list)  # steered sessions their client ended (no block left)
    expired: list[tuple[str, str]] = field(default_factory=list)  # (session id, why the server ended it)
    stop: bool = False

    @property
    def idle(self) -> bool:
        return not (self.opens or self.batch)


class Scheduler:
    def __init__(self, settings: ServingConfig) -> None:
        self.settings = settings
        # Every session not done, pending ones in arrival order, active ones in round-robin order.
        self.table: OrderedDict[str, SharedSession] = OrderedDict()

    def plan(self, events: list[RankEvents]) -> Plan:
        plan = Plan(stop=any(e.stop for e in events))
        if plan.stop:
            return plan
        for e in events:
            for sid, n in e.delivered.items():
                if (s := self.table.get(sid)) is not None:
                    s.delivered = max(s.delivered, n)
        opened_before = [s.id for s in self.table.values() if s.live]
        for sub in (s for e in events for s in e.submissions):  # steps may arrive with their first request
            self.table[sub.id] = sub
        for sid in (sid for e in events for sid in e.cancelled):
            if sid in self.table:
                self.finished(sid)
                plan.cancels.append(sid)
        for step in (step for e in events for step in e.steps):
            self._step(step, plan)
        for sid, reason in (x for e in events for x in e.expired):
            if (s := self.table.get(sid)) is not None and s.live:
                self.finished(sid)
                plan.expired.append((sid, reason))
        plan.batch = self._next_batch([sid for sid in opened_before if sid in self.table], plan)
        self._admit(plan)
        return plan

    def finished(self, session_id: str) -> None:
        """A session ended (last block, failed open, cancelled, ended, expired): free its slot."""
        if (s := self.table.pop(session_id, None)) is not None:
            s.state = State.DONE

    def _step(self, step: StepEvent, plan: Plan) -> None:
        s = self.table.get(step.session_id)
        if s is None:  # ended meanwhile: its owner answers the step
            return
        if step.controls is not None:
            s.steps.append(step.controls)
            s.requests += 1
        if step.end:
            s.state = State.ENDING
            if not s.steps:
                self.finished(s.id)
                plan.ends.append(s.id)

    def _admit(self, plan: Plan) -> None:
        """Open waiting sessions while slots last, keep up to max_queue waiting, reject the rest (newest)."""
        settings = self.settings
        slots = settings.max_sessions - sum(s.admitted for s in self.table.values())
        waiting = [s for s in self.table.values() if not s.admitted]
        for s in waiting[:slots]:
            s.admitted = True
            if s.state is State.PENDING:
                s.state = State.ACTIVE
            self.table.move_to_end(s.id)  # joins the round robin at its back
            plan.opens.append(s)
        for s in waiting[max(slots, 0) + settings.max_queue:]:
            self.finished(s.id)
            plan.rejects.append((s.id, self._queue_full()))

    def _next_batch(self, candidates: list[str], plan: Plan) -> list[str]:
        # Backpressure: a session whose client is max_blocks_ahead blocks behind waits for its deliveries.
        ready = [self.table[sid] for sid in candidates
                 if not self.table[sid].lags(self.settings.max_blocks_ahead) and self.table[sid].has_camera()]
        if not ready:
            return []
        shape = ready[0].block_shape  # the longest-waiting ready session picks the geometry
        batch = [s for s in ready if s.block_shape == shape][: self.settings.max_batch]
        for s in batch:  # served sessions go to the back: fair round robin
            self.table.move_to_end(s.id)
            s.computed += 1
            if s.steered:
                controls = s.steps.popleft() if s.steps else None  # None: hold the last motion
                plan.controls[s.id] = BlockControls(controls, last=s.state is State.ENDING and not s.steps)
        return [s.id for s in batch]

    def _queue_full(self) -> str:
        settings = self.settings
        return (
            f"server busy: {settings.max_queue} sessions already wait for a slot (max_queue={settings.max_queue}, "
            f"max_sessions={settings.max_sessions}); retry later"
        )
