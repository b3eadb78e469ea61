"""The group's decisions at a block boundary: slots (fair between keys), limits and each key's quotas, steering,
fair round-robin batches of sessions, parked worlds (off their slot, back at the front of the queue), and every move
of a session's status (`SharedSession.move`, along `sessions.TRANSITIONS`).

Pure logic on plain data. Every rank keeps its own copy and plans from the same events (every rank's, in rank
order), so every rank applies the same `Plan` in the same order without a broadcast. The scheduler is the one
writer of a session's status: a plan carries every session that ended, and why; the group loop only applies it. Its
one clock is the boundary's time, the latest of the ranks' clocks in the events (a key's blocks per hour).

Its counts are the group's books in process. Where groups share books (serving/books), what the owners learn from
them arrives as news like any other (a session seated, a key over its hour across the fleet): nothing here reads
the store.
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass, field

from ..api.refusal import Refusal
from ..engine.blocks import BlockControls
from . import messages
from .fair import HourlyUsage, fair_order
from .keys import KEY_REVOKED
from .news import Park, Parked, RankEvents, StepEvent
from .sessions import WAITING, EndReason, Ending, Parking, ResumeFrom, SharedSession, Status, Step
from .settings import ServingSettings


@dataclass
class Plan:
    """What every rank does next, in this order: save (moves, parks), end, leave slots (parked), open, run one batch,
    end the batch's finished sessions."""

    ended: list[tuple[str, Ending]] = field(default_factory=list)  # sessions that ended before the batch
    opens: list[SharedSession] = field(default_factory=list)
    batch: list[str] = field(default_factory=list)  # sessions that run their next block together
    controls: dict[str, BlockControls] = field(default_factory=dict)  # the steered sessions' of the batch
    finishing: list[tuple[str, Ending]] = field(default_factory=list)  # the batch's sessions that end after it
    # (session id, its prompt event's prompt): set the prompt, then recompute the cache; a boundary of its own
    recaches: list[tuple[str, str]] = field(default_factory=list)
    # (session id, snapshot id): save the session where it stands, first (its ending, MOVED, is in `ended`)
    moves: list[tuple[str, str]] = field(default_factory=list)
    # (session id, snapshot id): the batch's sessions saved after their block (their step asked for it)
    saves: list[tuple[str, str]] = field(default_factory=list)
    # (owner rank, session id, snapshot id): a save that never runs, its session having ended first (its queued
    # steps', a step that came after the end, a move of a session without a slot or of one ended at the same
    # boundary): its owner drops it
    unsaved: list[tuple[int, str, str]] = field(default_factory=list)
    # (session id, snapshot id, tier): an idle world saved where it stands into its park copy (it keeps its slot)
    parks: list[Park] = field(default_factory=list)
    # sessions whose park copy is durable: they leave their slot (every rank frees their caches)
    parked: list[str] = field(default_factory=list)
    # (owner rank, snapshot id, its park copy): a parked world moved by a drain: each rank copies its files of the
    # park copy into the snapshot, no block run (its ending, MOVED, is in `ended`)
    copies: list[tuple[int, str, ResumeFrom]] = field(default_factory=list)
    # (owner rank, session id, snapshot id, why): a park the group would not take, the world staying on its slot
    # (why: past max_parked; None: it is not idle, or ended): its owner drops the copy
    refused_parks: list[tuple[int, str, str, Refusal | None]] = field(default_factory=list)
    stop: bool = False

    @property
    def idle(self) -> bool:
        return not (self.opens or self.batch or self.recaches)

    def ended_by(self, reason: EndReason) -> list[str]:
        return [sid for sid, ending in self.ended if ending.reason is reason]


class Scheduler:
    def __init__(self, settings: ServingSettings) -> None:
        self.settings = settings
        # Every session not ended: waiting ones in arrival order, those with a slot in round-robin order.
        self.table: OrderedDict[str, SharedSession] = OrderedDict()
        self.now = 0.0  # the boundary's time: the latest rank clock any events carried
        self.turn = 0  # slots given so far: a key's last turn says how recently it was served
        self.last_served: dict[str, int] = {}  # key name -> its last turn, for the keys with a session in the table
        self.usage = HourlyUsage()

    def plan(self, events: list[RankEvents]) -> Plan:
        plan = Plan(stop=any(e.stop for e in events))
        if plan.stop:
            return plan
        self.now = max([self.now] + [e.clock_s for e in events])
        for e in events:
            for sid, n in e.delivered.items():
                if (s := self.table.get(sid)) is not None:
                    s.delivered = max(s.delivered, n)
        opened_before = [s.id for s in self.table.values() if s.holds_slot]
        for sub in (s for e in events for s in e.submissions):  # steps may arrive with their first request
            self.table[sub.id] = sub
        for sid, ending in (x for e in events for x in e.failed):
            self._end(sid, ending, plan)
        for sid in (sid for e in events for sid in e.cancelled):
            self._end(sid, Ending(EndReason.CANCELLED), plan)
        for rank, e in enumerate(events):  # before the steps: a step after a durable park brings the world back
            for parked in e.parked:
                self._parked(parked, rank, plan)
        for rank, e in enumerate(events):  # a step comes from its session's owner
            for step in e.steps:
                self._step(step, rank, plan)
        for sid, why in (x for e in events for x in e.expired):
            if (s := self.table.get(sid)) is not None and s.status not in WAITING:
                self._end(sid, Ending(EndReason.EXPIRED, why), plan)
        for sid in (sid for e in events for sid in e.seated):  # the fleet's books, as the owner heard them
            if (s := self.table.get(sid)) is not None and s.status is Status.WAITING_SEAT:
                s.move(Status.WAITING_SLOT)
        for sid, why in (x for e in events for x in e.over_quota):
            self._end(sid, Ending(EndReason.QUOTA, why), plan)
        revoked = {tag for e in events for tag in e.revoked}
        for s in [s for s in self.table.values() if s.principal.tag in revoked]:
            self._end(s.id, Ending(EndReason.REVOKED, KEY_REVOKED), plan)
        for rank, e in enumerate(events):  # after the steps: a world that asked for a block again is not parked
            for park in e.parking:
                self._park(park, rank, plan)
        for rank, e in enumerate(events):  # a move comes from its session's owner
            for sid, snapshot_id in e.moving:
                self._move(sid, snapshot_id, rank, plan)
        # Those on their slot since the last boundary and still on it (a world whose copy became durable here is off
        # its slot: its caches are freed before the batch runs).
        self._next_batch([sid for sid in opened_before if sid in self.table and self.table[sid].holds_slot], plan)
        self._admit(plan)
        self._forget_keys()
        return plan

    def abort(self, ending: Ending) -> None:
        """The group loop ends (unload, or a failure no plan can be agreed on): every session ends here."""
        for s in self.table.values():
            s.end(ending)
        self.table.clear()

    def _end(self, sid: str, ending: Ending, plan: Plan, before_batch: bool = True) -> None:
        """The only place a session ends (but `abort`): its slot is free from this plan on."""
        if (s := self.table.pop(sid, None)) is None:  # ended already
            return
        s.end(ending)
        plan.unsaved += [(s.owner, sid, step.snapshot_id) for step in s.steps if step.snapshot_id is not None]
        if before_batch:
            plan.ended.append((sid, ending))
        else:
            plan.finishing.append((sid, ending))

    def _move(self, sid: str, snapshot_id: str | None, owner: int, plan: Plan) -> None:
        """The group drains: a session with a slot is saved where it stands and ends MOVED, carrying its snapshot's
        id; a parked one moves from its park copy (copied into the snapshot, no block run; a copy on disk is itself
        the snapshot); one still in the queue (nothing to save) or without a snapshot ends SERVER_STOPPING. Its queued
        steps are its client's to send again where it resumes. One that ended meanwhile: its owner drops the snapshot
        (its end waits for every save of it to be over)."""
        if (s := self.table.get(sid)) is None:
            if snapshot_id is not None:
                plan.unsaved.append((owner, sid, snapshot_id))
            return
        if (s.holds_slot or s.in_park) and snapshot_id is not None:
            if s.holds_slot:
                plan.moves.append((sid, snapshot_id))
            elif snapshot_id != s.park_copy.snapshot_id:
                plan.copies.append((s.owner, snapshot_id, s.park_copy))
            self._end(sid, Ending(EndReason.MOVED, messages.moved(snapshot_id)), plan)
            return
        if snapshot_id is not None:  # nothing to save: its owner drops the snapshot it reserved
            plan.unsaved.append((s.owner, sid, snapshot_id))
        self._end(sid, Ending(EndReason.ABORTED, messages.DRAINING), plan)

    def _park(self, park: Park, owner: int, plan: Plan) -> None:
        """An idle steered world is saved where it stands into its park copy; it keeps its slot until the copy is
        durable. Refused (its owner drops the copy, the world stays on its slot) when it is not idle (a step asks
        for a block, its client ended it, or it parks already) or the group holds max_parked worlds: those parking
        or parked, not those returning (a returning world leaves its copy as it takes a slot: the idle world that
        parks may be the one whose slot it waits for)."""
        s = self.table.get(park.session_id)
        idle = s is not None and s.status is Status.RUNNING and s.steered and s.ending is None and not s.has_camera()
        held = sum(x.status in (Status.PARKING, Status.PARKED) for x in self.table.values())
        if not idle or held >= self.settings.max_parked:
            why = messages.park_full(self.settings.max_parked, self.settings.park_after_s) if idle else None
            plan.refused_parks.append((owner, park.session_id, park.snapshot_id, why))
            return
        s.move(Status.PARKING)
        s.parking = Parking(park.snapshot_id, park.tier, s.computed)
        plan.parks.append(park)

    def _parked(self, parked: Parked, owner: int, plan: Plan) -> None:
        """A park's copy is over. Dropped by its owner: the park under way is no more (the world may park again).
        Durable: the world leaves its slot (counted against its key's sessions still), unless it asked for a block
        since its copy was made (its owner then drops the copy). One that ended meanwhile: its owner drops the copy
        as it ends."""
        s = self.table.get(parked.session_id)
        if s is None or s.status is not Status.PARKING or s.parking.snapshot_id != parked.snapshot_id:
            return
        parking, s.parking = s.parking, None
        if parked.manifest is None:
            s.move(Status.RUNNING)
            return
        if s.computed != parking.block or s.has_camera():
            s.move(Status.RUNNING)
            plan.refused_parks.append((owner, s.id, parked.snapshot_id, None))
            return
        s.move(Status.PARKED)
        s.park_copy = ResumeFrom(parked.snapshot_id, parked.manifest, parking.block, park=parking.tier)
        plan.parked.append(s.id)

    def _unpark(self, s: SharedSession, plan: Plan) -> None:
        """A parked world that asked for a block gets a slot: every rank opens it from its park copy."""
        s.move(Status.RUNNING)
        s.resume, s.park_copy = s.park_copy, None
        self.table.move_to_end(s.id)  # joins the round robin at its back
        plan.opens.append(s)

    def _step(self, step: StepEvent, owner: int, plan: Plan) -> None:
        s = self.table.get(step.session_id)
        if s is None:  # ended meanwhile: its owner answers the step, and drops the save it carries
            if step.snapshot_id is not None:
                plan.unsaved.append((owner, step.session_id, step.snapshot_id))
            return
        if step.controls is not None:
            s.steps.append(Step(step.controls, step.snapshot_id))
            s.requests += 1
            if s.in_park:  # the parked worlds come back in the order they ask
                self.table.move_to_end(s.id)
                if s.status is Status.PARKED:
                    s.move(Status.RETURNING)
        if step.end:
            s.ending = Ending(EndReason.ENDED)
            if not s.steps:
                self._end(s.id, Ending(EndReason.ENDED), plan)

    def _admit(self, plan: Plan) -> None:
        """Open waiting sessions while slots last, fairly between keys (a session the fleet's books have not seated
        waits for its seat); refuse a key's sessions past its limits (newest first), then keep up to max_queue
        waiting and reject the rest (newest)."""
        settings = self.settings
        for s in self._arrived():
            if (refusal := self._over_quota(s)) is not None:
                self._end(s.id, Ending(EndReason.REJECTED, refusal), plan)
        live = [s for s in self.table.values() if s.holds_slot]
        slots = settings.max_sessions - len(live)
        returning = [s for s in self.table.values() if s.status is Status.RETURNING]
        for s in returning[:max(0, slots)]:  # the front of the queue
            self._unpark(s, plan)
        slots -= len(returning)
        live = [s for s in self.table.values() if s.holds_slot]
        for s in fair_order([s for s in self._arrived() if s.status is Status.WAITING_SLOT], live, self.last_served,
                            slots, parked=self._parked_worlds()):
            s.move(Status.RUNNING)
            self.table.move_to_end(s.id)  # joins the round robin at its back
            self.turn += 1
            self.last_served[s.user] = self.turn
            plan.opens.append(s)
        waiting = self._arrived()
        by_key: dict[str, int] = {}
        for s in waiting:
            by_key[s.user] = by_key.get(s.user, 0) + 1
        for s in reversed(waiting):  # a key's newest sessions past its queue limit
            quota = s.principal.quota
            if quota.queue is not None and by_key[s.user] > quota.queue:
                by_key[s.user] -= 1
                self._end(s.id, Ending(EndReason.REJECTED, messages.user_session_limit(s.user, quota.sessions,
                                                                                        quota.queue)), plan)
        # Its retry time is its owner's estimate from measured block times (no plan depends on a clock): 0 here.
        full = messages.queue_full(settings.max_queue, settings.max_sessions, retry_after_s=0.0)
        for s in self._arrived()[settings.max_queue:]:
            self._end(s.id, Ending(EndReason.REJECTED, full), plan)

    def _over_quota(self, s: SharedSession, batched: int = 0) -> Refusal | None:
        """The session's key has used its blocks for the hour (`batched`: its blocks in the batch being planned)."""
        limit = s.principal.quota.blocks_per_hour
        if limit is None or self.usage.used(s.user, self.now) + batched < limit:
            return None
        return messages.quota_exhausted(s.user, limit, self.usage.retry_after_s(s.user, limit, self.now))

    def _forget_keys(self) -> None:
        """Keys with no session left are forgotten: served again, they count as not served recently."""
        names = {s.user for s in self.table.values()}
        for name in [n for n in self.last_served if n not in names]:
            del self.last_served[name]
        self.usage.forget([n for n in self.usage.entries if n not in names], self.now)

    def _arrived(self) -> list[SharedSession]:
        """The new sessions waiting for a slot, in arrival order."""
        return [s for s in self.table.values() if s.status in WAITING]

    def _parked_worlds(self) -> list[SharedSession]:
        return [s for s in self.table.values() if s.in_park]

    def waiting(self) -> list[SharedSession]:
        """The queue: sessions waiting for a slot, first first (in the order they get slots if nothing else arrives:
        each one's true place): the parked worlds that asked for a block, then the fair queue's."""
        returning = [s for s in self.table.values() if s.status is Status.RETURNING]
        holders = [s for s in self.table.values() if s.holds_slot] + returning  # the returning take slots first
        return returning + fair_order(self._arrived(), holders, self.last_served,
                                      self.settings.max_sessions - len(holders), whole_queue=True,
                                      parked=[s for s in self.table.values() if s.status is Status.PARKED])

    def _next_batch(self, candidates: list[str], plan: Plan) -> None:
        # Backpressure: a session whose client is max_blocks_ahead blocks behind waits for its deliveries.
        ready = [self.table[sid] for sid in candidates
                 if not self.table[sid].lags(self.settings.max_blocks_ahead) and self.table[sid].has_camera()]
        if not ready:
            return
        if ready[0].recache_due():  # the longest-waiting ready session's recache runs alone at this boundary
            self._recache(ready[0], plan)
            return
        shape = ready[0].block_shape  # the longest-waiting ready session picks the geometry
        batch: list[SharedSession] = []
        per_key: dict[str, int] = {}
        for s in (s for s in ready if s.block_shape == shape and not s.recache_due()):
            if len(batch) == self.settings.max_batch:
                break
            if (refusal := self._over_quota(s, per_key.get(s.user, 0))) is not None:
                self._end(s.id, Ending(EndReason.QUOTA, refusal), plan)
                continue
            batch.append(s)
            if s.principal.quota.blocks_per_hour is not None:  # counted for the keys with a limit only
                per_key[s.user] = per_key.get(s.user, 0) + 1
        for name, blocks in per_key.items():
            self.usage.add(name, self.now, blocks)
        for s in batch:  # served sessions go to the back: fair round robin
            self.table.move_to_end(s.id)
            s.computed += 1
            if s.steered:
                step = s.steps.popleft() if s.steps else None  # None: hold the last motion
                plan.controls[s.id] = BlockControls(None if step is None else step.controls, recached=s.recached)
                s.recached = False
                if step is not None and step.snapshot_id is not None:
                    plan.saves.append((s.id, step.snapshot_id))
            plan.batch.append(s.id)
            if s.last_block_planned():  # its client's end flag, or its set length
                self._end(s.id, s.ending or Ending(EndReason.FINISHED), plan, before_batch=False)

    def _recache(self, s: SharedSession, plan: Plan) -> None:
        """Its event's prompt takes hold now, with its cache recomputed; its block runs at a later boundary, on
        the same step (without the event, which has happened). The other sessions wait for this boundary once."""
        step = s.steps[0]
        s.steps[0] = dataclasses.replace(step, controls=dataclasses.replace(step.controls, prompt=None, recache=False))
        s.recached = True
        self.table.move_to_end(s.id)
        plan.recaches.append((s.id, step.controls.prompt))
