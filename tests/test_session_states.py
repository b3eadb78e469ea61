"""A world's life tried in every order of its events: a stateful test (Hypothesis's `RuleBasedStateMachine`) feeds
the scheduler the news of a boundary as ranks send it (starts, resumes, steps, saves, end flags, cancels, the park
clock and its copies, expiry, a drain, a key revoked or over its hour, the books' seats) in whatever order and
combination, plans, and after every rule checks what a client and an operator rely on: slots and parked worlds
within their bounds and equal to the gauge, ended sessions gone and holding nothing, every news that ends a session
ending it at that boundary, every reserved snapshot saved or dropped, and every status reached only along
`TRANSITIONS` (docs/serving.md, "A session's lifecycle")."""
from __future__ import annotations

import dataclasses

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from backend.api.refusal import Refusal
from backend.api.request import Controls
from backend.engine.geometry import VideoGeometry
from backend.serving.keys import ANONYMOUS, Principal, Quota
from backend.serving.news import Park, Parked, RankEvents, StepEvent
from backend.serving.scheduler import Plan, Scheduler
from backend.serving.sessions import (HOLDS_SLOT, IN_PARK, TRANSITIONS, WAITING, EndReason, Ending, ResumeFrom,
                                      SharedSession, Status, Step, Tier)
from backend.serving.settings import ServingSettings
from backend.serving.waits import QueueCounts
from factories import tiny_request

GROUPS = (ServingSettings(max_sessions=1, max_queue=2, max_batch=1, max_blocks_ahead=2, max_parked=1),
          ServingSettings(max_sessions=2, max_queue=2, max_batch=2, max_blocks_ahead=2, max_parked=1),
          ServingSettings(max_sessions=2, max_queue=3, max_batch=2, max_blocks_ahead=2, max_parked=2))
KEYS = (ANONYMOUS, Principal("alice", "tag-a", Quota(sessions=2, blocks_per_hour=12)), Principal("bob", "tag-b"))
GEOMETRY = VideoGeometry(64, 64, 8, 8, 4, 4, 3, 3 * 3, 1)  # a clip of 3 blocks; steered sessions set their own
WHY = Refusal("EXPIRED", "its limit")

MOVES: list[tuple[str, Status, Status]] = []  # every status move as `SharedSession.move` made it: (id, from, to)
MOVE = SharedSession.move


def recorded_move(session: SharedSession, status: Status) -> None:
    before = session.status
    MOVE(session, status)
    MOVES.append((session.id, before, status))


class SessionLife(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.scheduler = Scheduler(GROUPS[0])
        self.events = RankEvents()
        self.sessions: dict[str, SharedSession] = {}  # every session submitted, ended or not
        self.statuses: dict[str, Status] = {}  # each one's status as its last move left it
        self.ended: set[str] = set()
        self.drained: set[str] = set()
        self.clock_s = 0.0
        self.reserved: dict[str, str] = {}  # snapshot id -> its session: a save its owner reserved, not yet told
        self.parks: dict[str, str] = {}  # session -> the snapshot of its park the scheduler took, not yet over
        self.ids = iter(range(10**6))
        MOVES.clear()

    def _sid(self, n: int, status: Status | None = None, idle: bool = False) -> str | None:
        """A session the news is about: mostly one in the table (in `status`, idle: a steered one without a step,
        where one is), at times any, ended ones too (late news)."""
        ids = [sid for sid, s in self.scheduler.table.items() if (status is None or s.status is status)
               and not (idle and (s.steps or not s.steered))] or list(self.scheduler.table)
        if n % 4 == 0 or not ids:
            ids = list(self.sessions)
        return ids[n // 4 % len(ids)] if ids else None

    def _snapshot(self) -> str:
        return f"{next(self.ids):032x}"

    @initialize(group=st.sampled_from(GROUPS))
    def start(self, group: ServingSettings) -> None:
        self.scheduler = Scheduler(group)

    # -- the owner's news: each rule adds some to the next boundary's, and plans that boundary at once or not (news
    # -- that arrives together meets in one plan)

    def _sent(self, now: bool) -> None:
        if now:
            self.boundary(read=True)

    @rule(steered=st.booleans(), hold=st.booleans(), key=st.sampled_from(KEYS), seated=st.sampled_from([True] * 3
          + [False]), resumed=st.booleans(), max_blocks=st.sampled_from([0, 3]), now=st.booleans())
    def submit(self, steered: bool, hold: bool, key: Principal, seated: bool, resumed: bool, max_blocks: int,
               now: bool) -> None:
        """A start (a clip, or a steered world) or a resume, seated by the fleet's books or waiting for its seat (up
        to a full queue: more are refused alike)."""
        group = self.scheduler.settings
        if len(self.scheduler.table) + len(self.events.submissions) > group.max_sessions + group.max_parked + group.max_queue:
            return
        sid = f"s{next(self.ids)}"
        request = tiny_request(num_frames=9)
        if steered or resumed:
            request = dataclasses.replace(request, num_frames=None, poses=None, keys="w", sequence_id=sid,
                                          on_starve="hold" if hold else "wait", max_blocks=max_blocks)
        if resumed:
            session = SharedSession.resumed(sid, request, GEOMETRY, 0, key, ResumeFrom(self._snapshot(), "{}", 1),
                                            Step(Controls(keys="w")))
        else:
            session = SharedSession.submitted(sid, request, GEOMETRY, 0, key)
        if not seated:
            session.status = Status.WAITING_SEAT  # its first status, as its owner shares it
        self.sessions[sid] = session
        self.statuses[sid] = session.status
        self.events.submissions.append(session)
        self._sent(now)

    @rule(n=st.integers(0, 99), of=st.sampled_from([None, Status.PARKED, Status.PARKING]), keys=st.sampled_from("wasd"),
          end=st.sampled_from([False] * 3 + [True]), save=st.booleans(), now=st.booleans())
    def step(self, n: int, of: Status | None, keys: str, end: bool, save: bool, now: bool) -> None:
        """A step (a parked world's brings it back), with a save or the end flag."""
        if (sid := self._sid(n, of)) is not None and self.sessions[sid].steered:
            snapshot_id = self._snapshot() if save else None
            if snapshot_id is not None:
                self.reserved[snapshot_id] = sid
            self.events.steps.append(StepEvent(sid, Controls(keys=keys, save=save), end, snapshot_id))
        self._sent(now)

    @rule(n=st.integers(0, 99), kind=st.sampled_from(["end flag", "vanished", "limit", "decode failed", "over hour",
                                                      "key revoked"]), now=st.booleans())
    def news_that_ends(self, n: int, kind: str, now: bool) -> None:
        """Its client's end flag alone, its client gone, its idle or lifetime limit, its decode failed on its
        owner, its key over its hour across the fleet, or its key revoked."""
        if (sid := self._sid(n)) is None:
            return
        if kind == "end flag" and self.sessions[sid].steered:
            self.events.steps.append(StepEvent(sid, None, end=True))
        elif kind == "vanished":
            self.events.cancelled.append(sid)
        elif kind == "limit":
            self.events.expired.append((sid, WHY))
        elif kind == "decode failed":
            self.events.failed.append((sid, Ending(EndReason.FAILED, WHY)))
        elif kind == "over hour":
            self.events.over_quota.append((sid, WHY))
        elif kind == "key revoked" and self.sessions[sid].principal.tag:
            self.events.revoked.append(self.sessions[sid].principal.tag)
        self._sent(now)

    @rule(n=st.integers(0, 99), now=st.booleans())
    def delivered(self, n: int, now: bool) -> None:
        """Its client received every block planned (a session held back by it may run)."""
        if (sid := self._sid(n)) is not None:
            self.events.delivered[sid] = self.sessions[sid].computed
        self._sent(now)

    @rule(n=st.integers(0, 99), now=st.booleans())
    def seated_by_the_books(self, n: int, now: bool) -> None:
        if (sid := self._sid(n, Status.WAITING_SEAT)) is not None:
            self.events.seated.append(sid)
        self._sent(now)

    @rule(n=st.integers(0, 99), tier=st.sampled_from(Tier), copy=st.sampled_from(["later", "durable", "dropped"]),
          step=st.booleans(), now=st.booleans())
    def park_clock(self, n: int, tier: Tier, copy: str, step: bool, now: bool) -> None:
        """Its owner's clock says a world is due to park (whether it is idle is the scheduler's to say); its copy's
        news comes later (`park_copy_over`), or at the next boundary, durable or dropped, with a step of the world
        or without."""
        if (sid := self._sid(n, Status.RUNNING, idle=True)) is not None:
            self.events.parking.append(Park(sid, self._snapshot(), tier))
            if copy != "later":
                self.boundary(read=True)
                if sid in self.parks:
                    self.events.parked.append(Parked(sid, self.parks.pop(sid), "{}" if copy == "durable" else None))
                if step:
                    self.events.steps.append(StepEvent(sid, Controls(keys="d")))
        self._sent(now)

    @rule(n=st.integers(0, 99), durable=st.booleans(), stale=st.sampled_from([False] * 3 + [True]),
          now=st.booleans())
    def park_copy_over(self, n: int, durable: bool, stale: bool, now: bool) -> None:
        """A park's copy durable or dropped (stale: news of a copy the scheduler no longer waits for)."""
        if stale and (sid := self._sid(n)) is not None:
            self.events.parked.append(Parked(sid, self._snapshot(), "{}" if durable else None))
        elif self.parks:
            sid = sorted(self.parks)[n % len(self.parks)]
            self.events.parked.append(Parked(sid, self.parks.pop(sid), "{}" if durable else None))
        self._sent(now)

    @rule(n=st.integers(0, 99), saved=st.booleans(), now=st.booleans())
    def drain(self, n: int, saved: bool, now: bool) -> None:
        """The group drains a session: its owner reserved a snapshot for it (a world parked on disk: its copy), or
        none (no room). Its owner drains it once."""
        if (sid := self._sid(n)) is not None and sid not in self.drained:
            self.drained.add(sid)
            s, snapshot_id = self.sessions[sid], None
            if saved and s.park_copy is not None and s.park_copy.park is Tier.DISK:
                snapshot_id = s.park_copy.snapshot_id
            elif saved:
                snapshot_id = self._snapshot()
                self.reserved[snapshot_id] = sid
            self.events.moving.append((sid, snapshot_id))
        self._sent(now)

    # -- the boundary

    @rule(read=st.booleans())
    def boundary(self, read: bool) -> None:
        """A block boundary, two minutes of its clock after the last (a key's blocks age out of its hour); read:
        every client has received every block planned (else only those the `delivered` rule said)."""
        if read:
            self.events.delivered.update({sid: s.computed for sid, s in self.scheduler.table.items()})
        self.clock_s += 120.0
        events, self.events = self.events, RankEvents(clock_s=self.clock_s)
        statuses = {sid: s.status for sid, s in self.scheduler.table.items()}
        plan = self.scheduler.plan([events])
        self.check_plan(events, plan, statuses)

    def check_plan(self, events: RankEvents, plan: Plan, before: dict[str, Status]) -> None:
        table = self.scheduler.table
        ended = [sid for sid, _ in plan.ended + plan.finishing]
        assert len(ended) == len(set(ended)), plan
        self.ended.update(ended)
        # Each news that ends a session ends it at this boundary.
        for sid in events.cancelled + [sid for sid, _ in events.failed + events.over_quota]:
            assert sid not in table, (sid, "still in the table after news that ends it")
        for sid, _ in events.expired:
            assert sid not in table or before.get(sid, Status.WAITING_SLOT) in WAITING  # a limit runs on a slot
        revoked = set(events.revoked)
        assert not [s for s in table.values() if s.principal.tag in revoked]
        endings = dict(plan.ended)
        for sid, snapshot_id in events.moving:  # a drain moves every world it can, naming its snapshot
            assert sid not in table
            if (ending := endings.get(sid)) is not None and ending.reason is EndReason.MOVED:
                assert snapshot_id is not None and ending.error.snapshot_id == snapshot_id
                assert (sid, snapshot_id) in plan.moves or snapshot_id in [c[1] for c in plan.copies] \
                    or snapshot_id not in self.reserved  # a world parked on disk: its copy is the snapshot
            elif ending is not None and snapshot_id is not None and before.get(sid) in HOLDS_SLOT | IN_PARK:
                assert ending.reason is not EndReason.ABORTED, (sid, ending)  # other news ended it first
        # The batch runs on sessions open on their slot as the loop applies the plan (it takes the parked ones off
        # theirs, then opens, then runs the batch).
        finishing, opened = {sid for sid, _ in plan.finishing}, {s.id for s in plan.opens}
        for sid in plan.batch:
            assert sid in finishing or table[sid].status in HOLDS_SLOT, (sid, table.get(sid))
            assert sid not in plan.parked or sid in opened, (sid, "runs a block off its slot")
        # Every snapshot a save reserved is saved or dropped once its session ends.
        for sid, snapshot_id in plan.saves:
            assert self.reserved.pop(snapshot_id) == sid
        for _, sid, snapshot_id in plan.unsaved:  # (a drain's of a world parked on disk is its copy: no save)
            assert self.reserved.pop(snapshot_id) == sid if snapshot_id in self.reserved else (sid, snapshot_id) \
                in events.moving
        for sid, snapshot_id in plan.moves:
            assert self.reserved.pop(snapshot_id) == sid
        for _, snapshot_id, _ in plan.copies:
            assert (self.reserved.pop(snapshot_id), snapshot_id) in events.moving
        assert not [sid for sid in self.reserved.values() if sid not in table], self.reserved
        # A park news is taken or refused at once; one taken is under way until its copy is over.
        asked = [p.snapshot_id for p in events.parking]
        taken = [p.snapshot_id for p in plan.parks]
        refused = [r[2] for r in plan.refused_parks if r[2] in asked]
        assert sorted(taken + refused) == sorted(asked)
        for park in plan.parks:
            self.parks[park.session_id] = park.snapshot_id
        for sid in [sid for sid in self.parks if sid not in table or table[sid].status is not Status.PARKING]:
            del self.parks[sid]  # ended or dropped: its owner drops the copy

    # -- after every rule

    @invariant()
    def bounds(self) -> None:
        group, table = self.scheduler.settings, self.scheduler.table.values()
        assert sum(s.status in HOLDS_SLOT for s in table) <= group.max_sessions
        assert sum(s.status in (Status.PARKING, Status.PARKED) for s in table) <= group.max_parked
        parked = sum(s.status in IN_PARK for s in table)
        assert parked <= group.max_parked and QueueCounts.of(self.scheduler, group, []).parked == parked

    @invariant()
    def ended_sessions_hold_nothing(self) -> None:
        for sid in self.ended:
            s = self.sessions[sid]
            assert sid not in self.scheduler.table and s.status is Status.ENDED and s.ending is not None
            assert s.parking is None and s.park_copy is None
        for sid, s in self.scheduler.table.items():
            assert s.status is not Status.ENDED and sid not in self.ended
            assert (s.parking is not None) == (s.status is Status.PARKING)
            assert (s.park_copy is not None) == (s.status in IN_PARK)
            assert s.status is not Status.PARKED or not s.has_camera(), (sid, "parked with a block asked")
            assert s.status is not Status.RETURNING or s.has_camera(), (sid, "returning with no block asked")

    @invariant()
    def statuses_move_only_along_the_table(self) -> None:
        for sid, before, after in MOVES:
            assert after in TRANSITIONS[before] and self.statuses[sid] is before, (sid, before, after)
            self.statuses[sid] = after
        MOVES.clear()
        assert {sid: s.status for sid, s in self.sessions.items()} == self.statuses


def test_a_world_s_life_in_every_order_of_its_events(monkeypatch) -> None:
    """Bounded and derandomized: the same 300 lives of up to 80 rules each on every run."""
    monkeypatch.setattr(SharedSession, "move", recorded_move)
    run_state_machine_as_test(SessionLife, settings=settings(
        derandomize=True, database=None, max_examples=150, stateful_step_count=80, deadline=None,
        suppress_health_check=[HealthCheck.too_slow]))
