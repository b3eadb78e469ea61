"""A world's life on its owner, tried in every order of its events: a stateful test (Hypothesis's
`RuleBasedStateMachine`) drives the real intake (its saves, parks, sequences and leases, over stores in a temporary
folder and fake books) and a fake group loop that plans with the real scheduler on the letters the intake posts and
answers as the loop would (opens, blocks, endings, places, the files of its saves). The rules are what clients do
(start, step, pause, save, go away while queued, seated, parked, mid-save or mid-park), the owner's clock (parks,
idle limits), the writer's files (written or failed), a drain, a key revoked and the books down and back; after
every rule it checks what a client and an operator rely on: slots and parked worlds within their bounds and equal to
the gauge, a vanished client's session ended within its bound, an ended session holding nothing on its owner (no
stream, sequence, save, park copy, lease, retry), every response well-formed and every stream ended once, and every
MOVED naming a durable snapshot. No thread runs: the intake's inbox is read on the test's thread, on a fake clock."""
from __future__ import annotations

import dataclasses
import queue
import shutil
import tempfile
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

from backend.api import contract as c
from backend.api.errors import Refused
from backend.api.refusal import Refusal
from backend.api.request import Controls, StepRequest
from backend.engine.blocks import BlockOutput
from backend.engine.snapshot.store import STAGING
from backend.serving import intake as intake_module, mail, messages, parks as parks_module, streams
from backend.serving.bootstrap import owner_side
from backend.serving.books import BooksUnavailable, Hour, Taken
from backend.serving.keys import ANONYMOUS
from backend.serving.leases import Leases
from backend.serving.news import FilesWritten, Park, Parked, RankEvents
from backend.serving.scheduler import Scheduler
from backend.serving.sessions import HOLDS_SLOT, IN_PARK, EndReason, Ending, SharedSession, Status
from backend.serving.settings import ServingSettings
from backend.serving.waits import QueueCounts
from factories import tiny_request
from test_intake import files_written, principal, steered_start

IDLE_S, PARK_S = 30.0, 3.0  # the owner's idle limit and park clock, in the fake clock's seconds
ALICE = principal("alice", sessions=1, queue=1)  # a key whose sessions the books count
KEYS = (ANONYMOUS, ALICE)


class Clock:
    """The owner's monotonic clock (the real one plus what the rules advanced it by); wall time stays real. A
    session's lifetime counts on the real clock (`OwnerPart.started_s`): max_session_s is out of reach here."""

    def __init__(self) -> None:
        self.offset = 0.0

    def monotonic(self) -> float:
        return REAL_MONOTONIC() + self.offset


REAL_MONOTONIC = time.monotonic
CLOCK = Clock()
REACHED: set = set()  # the statuses and endings the lives reached: each the invariants were checked in


class Reply:
    """One request's reply channel as its client sees it, closed by its first final response as Triton's is (what is
    sent after is dropped: serving's adapter/responder); every response is checked as it comes."""

    def __init__(self, world: World) -> None:
        self.world, self.blocks, self.ends, self.code, self.cancelled = world, [], 0, None, False

    def send_block(self, output: BlockOutput, frames: np.ndarray, decode_ms: float, final: bool) -> None:
        assert not self.ends, (self.world.key, output.block_index, "a block sent on a closed stream is lost")
        if self.world.steered:
            assert final and not self.blocks, (self.world.key, "a steered request answered by more than one block")
        self.blocks.append(output.block_index)
        self.world.blocks.append(output.block_index)
        self.ends += final

    def send_error(self, refusal: Refusal) -> None:
        assert refusal.code and refusal.sentence, refusal
        if self.ends:
            return
        if refusal.code == c.MOVED:  # a moved world's id is named only once its snapshot is durable
            named = [d for d in self.world.root.iterdir() if d.name in refusal.sentence]
            assert named and (named[0] / "manifest.json").is_file(), (refusal, "MOVED names no durable snapshot")
            self.world.moved = True
        self.code = refusal.code
        self.ends += 1

    def send_place(self, position: int, wait_s: float) -> None:
        assert position >= 0 and wait_s >= 0 and not self.ends

    def send_notice(self, notice) -> None:
        assert not self.ends, (self.world.key, "a save's outcome sent on a closed stream is lost")

    def send_saves(self, listing: str) -> None:
        self.ends += not self.ends

    def finish(self) -> None:
        self.ends += not self.ends

    def is_cancelled(self) -> bool:
        return self.cancelled or self.ends > 0


@dataclasses.dataclass
class World:
    """One client's world: its sequence, its key, its requests' replies."""

    key: str
    steered: bool
    who: object
    root: Path | None
    sid: str | None = None
    replies: list[Reply] = dataclasses.field(default_factory=list)
    blocks: list[int] = dataclasses.field(default_factory=list)
    gone: bool = False  # its client went away: it sends nothing more
    moved: bool = False

    def open(self) -> bool:
        """Whether one of its requests is not answered yet."""
        return any(not r.ends for r in self.replies)


class FakeBooks:
    """The fleet's books: a key's `sessions` seats, then its `queue` places; `down`: every call fails."""

    def __init__(self) -> None:
        self.down = False
        self.seats: dict[str, str] = {}  # lease id -> key name
        self.queue: dict[str, str] = {}

    def _call(self) -> None:
        if self.down:
            raise BooksUnavailable("the books did not answer: stopped")

    def take(self, name, lease_id, quota, lease_s) -> Taken:
        self._call()
        if sum(n == name for n in self.seats.values()) < quota.sessions:
            self.seats[lease_id] = name
            return Taken("seat")
        if sum(n == name for n in self.queue.values()) < quota.queue:
            self.queue[lease_id] = name
            return Taken("queue")
        return Taken("full")

    def promote(self, name, lease_id, sessions, lease_s) -> bool:
        self._call()
        if lease_id in self.seats:
            return True
        if lease_id in self.queue and sum(n == name for n in self.seats.values()) < sessions:
            self.seats[lease_id] = self.queue.pop(lease_id)
            return True
        return False

    def renew(self, leases, lease_s) -> bool:
        self._call()
        return True

    def add_blocks(self, name, blocks) -> Hour:
        self._call()
        return Hour(time.time(), ())

    def release(self, name, lease_id) -> None:
        self._call()
        self.seats.pop(lease_id, None)
        self.queue.pop(lease_id, None)


class Bookkeeper:
    """The books thread, run on the test's thread: each letter handled as it is posted, its answers kept for the
    intake's next read."""

    def __init__(self, books: FakeBooks, answers: list) -> None:
        self.leases = Leases(books, 15.0, answers.append, clock=CLOCK.monotonic)
        self.answers = answers

    def post(self, letter) -> None:
        match letter:
            case mail.Lease(sid, who):
                try:
                    self.answers.append(mail.Leased(sid, self.leases.take(sid, who)))
                except Refused as exc:
                    self.answers.append(mail.Leased(sid, False, exc.refusal))
            case mail.Block(sid):
                self.leases.delivered(sid)
            case mail.Release(sid):
                self.leases.ended(sid)

    def close(self) -> None:
        self.leases.close()

    def join(self, timeout_s: float) -> None:
        pass


class OwnerLife(RuleBasedStateMachine):
    group = ServingSettings(max_sessions=2, max_queue=2, max_batch=2, max_blocks_ahead=2, max_parked=1,
                            session_idle_timeout_s=IDLE_S, park_after_s=PARK_S, max_session_s=10.0**9)

    def __init__(self) -> None:
        super().__init__()
        CLOCK.offset = 0.0
        self.folder = Path(tempfile.mkdtemp(prefix="owner-states-"))
        self.disk, self.memory = self.folder / "disk", self.folder / "memory"
        self.settings = dataclasses.replace(self.group, snapshot_dir=str(self.disk), park_memory_dir=str(self.memory))
        self.letters: list = []  # what the intake told the group loop, not read yet
        self.side = owner_side(0, 1, self.settings, ENGINE, self.letters.append, queue.SimpleQueue())
        self.side.close()  # its thread ends; its inbox is read here from now on (`pump`)
        self.books, self.answers = FakeBooks(), []
        self.side._books = Bookkeeper(self.books, self.answers)
        self.scheduler = Scheduler(self.settings)
        self.shared: dict[str, SharedSession] = {}
        self.worlds: list[World] = []
        self.written: list[FilesWritten] = []  # files of saves the writer finished: for the next boundary
        self.writing: list[tuple[str, Path]] = []  # saves the group made, their files not written yet
        self.revoked: list[str] = []
        self.told: dict[str, int] = {}  # the place each owned session was last told
        self.vanished: dict[str, float] = {}  # sid -> by when its owner knows its client went away (fake clock)
        self.boundaries = 0
        self.drained = False

    def teardown(self) -> None:
        """The group loop ends: every stream still open is answered, once."""
        self.scheduler.abort(Ending(EndReason.ABORTED, messages.GROUP_FAILED))
        self.side._handle(mail.Closed(messages.GROUP_FAILED))
        for world in self.worlds:
            for reply in world.replies:
                assert reply.ends == 1, (world.key, reply.ends, "a stream not ended exactly once")
        shutil.rmtree(self.folder, ignore_errors=True)

    # -- the intake's thread, run here --------------------------------------------------------------------------

    def pump(self) -> None:
        """The intake reads its inbox and the books' answers, then looks at its clients and clocks (`Intake._run`)."""
        side = self.side
        while True:
            letters = []
            while not side._inbox.empty():
                letters.append(side._inbox.get_nowait())
            letters += self.answers
            self.answers.clear()
            if not letters:
                break
            for letter in letters:
                if letter is not intake_module._CLOSE:
                    side._handle(letter)
        now = CLOCK.monotonic()
        side._watch_cancellations()
        side._watch_limits(now)
        for park in () if side._draining else side._parks.start_due(side._parts, now):
            self.letters.append(park)
        if self.answers:
            self.pump()

    def _arrive(self, world: World, request) -> Reply:
        reply = Reply(world)
        world.replies.append(reply)
        before = set(self.side._parts)
        self.side.arrive(world.key if world.steered else "", request, reply, principal=world.who)
        self.pump()
        if world.sid is None and (new := set(self.side._parts) - before):
            world.sid = new.pop()
        return reply

    def _world(self, n: int, steered_only: bool = True) -> World | None:
        """A world whose client is still there (a steered one: one that sends steps)."""
        live = [w for w in self.worlds if not w.gone and w.sid is not None and (w.steered or not steered_only)]
        return live[n % len(live)] if live else None

    # -- clients ------------------------------------------------------------------------------------------------

    @initialize(worlds=st.lists(st.tuples(st.sampled_from([True, True, False]), st.sampled_from(KEYS)), min_size=1,
                                max_size=3))
    def first_worlds(self, worlds: list) -> None:
        """A few clients start at once, and the group plans."""
        for steered, who in worlds:
            self.start(steered, who, False)
        self._boundary()

    @rule(steered=st.sampled_from([True, True, False]), who=st.sampled_from(KEYS), save=st.booleans())
    def start(self, steered: bool, who, save: bool) -> None:
        if len(self.worlds) >= 16 or sum(w.sid in self.side._parts for w in self.worlds) >= 6:
            return
        world = World(f"q{len(self.worlds)}", steered, who, self.disk)
        self.worlds.append(world)
        if steered:
            request = steered_start(world.key)
            if save:
                request = dataclasses.replace(request, save=True)
        else:
            request = tiny_request(decode=False)
        self._arrive(world, request)

    @rule(n=st.integers(0, 15), save=st.sampled_from([False, False, True]), end=st.sampled_from([False] * 4 + [True]),
          keys=st.sampled_from("wasd"))
    def step(self, n: int, save: bool, end: bool, keys: str) -> None:
        if (world := self._world(n)) is not None:
            self._arrive(world, StepRequest(world.key, Controls(keys=keys, save=save), end=end))

    @rule(n=st.integers(0, 15))
    def pause(self, n: int) -> None:
        if (world := self._world(n)) is not None:
            self._arrive(world, StepRequest(world.key, None, pause=True))

    @rule(n=st.integers(0, 15))
    def end_flag(self, n: int) -> None:
        if (world := self._world(n)) is not None:
            self._arrive(world, StepRequest(world.key, None, end=True))

    @rule(n=st.integers(0, 15))
    def vanish(self, n: int) -> None:
        """The client goes away (its connection closes): its open requests read cancelled; it sends nothing more."""
        if (world := self._world(n, steered_only=False)) is None:
            return
        world.gone = True
        for reply in world.replies:
            reply.cancelled = True
        if world.sid in self.side._parts:
            now = CLOCK.monotonic()
            self.vanished[world.sid] = now if world.open() else now + IDLE_S
        self.pump()

    # -- the owner's clock, the writer, the operator, the books ---------------------------------------------------

    @rule(dt=st.sampled_from([1.0, PARK_S, IDLE_S]))
    def clock(self, dt: float) -> None:
        CLOCK.offset += dt
        self.pump()

    @rule(n=st.integers(0, 15), ok=st.sampled_from([True, True, False]))
    def files(self, n: int, ok: bool) -> None:
        """The writer finished a save's files (every rank's: one rank here), or failed."""
        if not self.writing:
            return
        snapshot_id, root = self.writing.pop(n % len(self.writing))
        try:
            report = files_written(self.side, snapshot_id, root) if ok else None
        except Exception:  # its reservation went (a dropped save): a rank cannot write into it
            report = None
        self.written.append(report or FilesWritten(snapshot_id, 0, 0, (), messages.save_failed(snapshot_id)))

    @precondition(lambda self: self.boundaries >= 12 and not self.drained)
    @rule()
    def drain(self) -> None:
        """The server drains: every steered world on its owner is moved, its snapshot reserved (the store has room)."""
        self.drained = True
        playing = {sid for sid, part in self.side._parts.items() if part.steered and part.ending is None}
        self.side.post(mail.Drain())
        self.pump()
        moving = {letter.session_id: letter.snapshot_id for letter in self.letters if isinstance(letter, mail.Moving)}
        assert set(moving) == playing and None not in moving.values(), (moving, playing)

    @rule()
    def revoke(self) -> None:
        self.revoked.append(ALICE.tag)

    @rule(down=st.booleans())
    def books_down_or_back(self, down: bool) -> None:
        self.books.down = down
        if not down:
            CLOCK.offset += 1.0  # past RETRY_S: the books are asked again

    @rule()
    def books_tick(self) -> None:
        self.side._books.leases.tick()
        self.pump()

    # -- the group loop -----------------------------------------------------------------------------------------

    @rule(runs=st.integers(1, 4), files=st.sampled_from(["none", "written", "failed"]),
          dt=st.sampled_from([0.0, 0.0, 1.0, PARK_S]))
    def boundary(self, runs: int, files: str, dt: float) -> None:
        """Block boundaries, the writer first finishing every save under way (or none), with the owner's clock
        advanced first by `dt`."""
        self.clock(dt)
        for _ in range(runs):
            while files != "none" and self.writing:
                self.files(0, files == "written")
            self._boundary()

    def _boundary(self) -> None:
        """One block boundary as `GroupLoop` runs it on one rank: collect, plan, hand on the saves, apply, tell
        places."""
        self.pump()
        now = CLOCK.monotonic()
        self.boundaries += 1
        events = RankEvents(clock_s=time.time(), revoked=self.revoked)
        self.revoked = []
        delivered: dict[str, int] = {}
        for letter in self.letters:
            match letter:
                case mail.Submitted(shared):
                    events.submissions.append(shared)
                    self.shared[shared.id] = shared
                case mail.Stepped(step):
                    events.steps.append(step)
                case mail.Cancelled(sid):
                    events.cancelled.append(sid)
                case mail.Expired(sid, why):
                    events.expired.append((sid, why))
                case mail.Delivered(sid, blocks):
                    delivered[sid] = blocks
                case mail.Moving(sid, snapshot_id):
                    events.moving.append((sid, snapshot_id))
                case mail.Seated(sids):
                    events.seated.extend(sids)
                case mail.OverQuota(sid, why):
                    events.over_quota.append((sid, why))
                case Park():
                    events.parking.append(letter)
                case Parked():
                    events.parked.append(letter)
        self.letters.clear()
        events.delivered = {sid: n for sid, n in delivered.items() if (s := self.scheduler.table.get(sid)) is not None
                            and n > s.delivered}
        plan = self.scheduler.plan([events])
        REACHED.update(s.status for s in self.scheduler.table.values())
        REACHED.update(ending.reason for _, ending in plan.ended + plan.finishing)
        to = self.side._handle
        for report in self.written:
            to(report)
        self.written = []
        for _, _, snapshot_id in plan.unsaved:
            to(mail.Unsaved(snapshot_id))
        for _, _, snapshot_id, why in plan.refused_parks:
            to(mail.ParkRefused(snapshot_id, why))
        self.writing += [(snapshot_id, self.disk) for _, snapshot_id in plan.moves]
        self.writing += [(snapshot_id, self.disk) for _, snapshot_id, _ in plan.copies]
        self.writing += [(p.snapshot_id, self.memory if p.tier.value == "memory" else self.disk) for p in plan.parks]
        for sid, ending in plan.ended:
            self._end(sid, ending)
        for shared in plan.opens:
            to(mail.Opened(shared.id))
        finishing = dict(plan.finishing)
        for sid in plan.batch:
            s = self.shared[sid]
            to(mail.Decoded(sid, BlockOutput(sid, s.computed - 1, 0, torch.zeros(1), 0.0, 0), np.zeros(1), 0.0,
                            sid in finishing))
        self.writing += [(snapshot_id, self.disk) for _, snapshot_id in plan.saves]
        for sid, ending in plan.finishing:
            self._end(sid, ending)
        places = {s.id: n for n, s in enumerate(self.scheduler.waiting(), start=1)}
        for sid in self.scheduler.table:
            if (place := places.get(sid, 0)) != self.told.get(sid, 0):
                self.told[sid] = place
                to(mail.Placed(sid, place, 1.0 if place else 0.0))
        self.pump()
        self.check_vanished(now)

    def _end(self, sid: str, ending) -> None:
        told = ending.told()
        self.told.pop(sid, None)
        self.side._handle(mail.Ended(sid, None if ending.error is None else told, told))

    # -- after every rule -----------------------------------------------------------------------------------------

    def check_vanished(self, now: float) -> None:
        """A vanished client's session is ended by the first boundary after its owner read its request cancelled
        (one was open as it went), else by the first after its idle limit ran out (`now`: the boundary's clock)."""
        for sid, due in self.vanished.items():
            if due <= now:
                assert sid not in self.scheduler.table, (sid, self.scheduler.table[sid].status, "its client went away")

    @invariant()
    def bounds(self) -> None:
        table = self.scheduler.table.values()
        assert sum(s.status in HOLDS_SLOT for s in table) <= self.settings.max_sessions
        parked = sum(s.status in IN_PARK for s in table)
        assert parked <= self.settings.max_parked
        assert QueueCounts.of(self.scheduler, self.settings, []).parked == parked

    @invariant()
    def ended_sessions_hold_nothing_on_their_owner(self) -> None:
        side = self.side
        saving = {s.session_id for s in side._saves._saves.values()}
        # An ended session's save still reserved is one whose block ran: the writer's files of it are still to come.
        writing = {snapshot_id for snapshot_id, _ in self.writing} | {r.snapshot_id for r in self.written}
        for save in side._saves._saves.values():
            if (shared := self.shared.get(save.session_id)) is not None and shared.status is Status.ENDED:
                assert save.snapshot_id in writing, (save.session_id, save.purpose, "a reservation left behind")
        for sid, shared in self.shared.items():
            if shared.status is not Status.ENDED or sid in saving:
                continue
            assert sid not in side._parts, (sid, "an ended session's stream is held")
            assert sid not in side._taking
            assert sid not in side._sequences._steering.values(), (sid, "its sequence still steers it")
            assert sid not in side._parks._parks, (sid, "its park copy is held")
            assert sid not in side._parks._retry, (sid, "its park retry is held")
            assert sid not in side._books.leases._leases, (sid, "its lease is held")
        for world in self.worlds:
            if world.sid is not None and world.sid not in side._parts and world.sid not in side._taking:
                assert not world.open(), (world.key, "a stream of an ended session is left open")
        # What the park tier holds in memory: the copies of the parks under way or parked, and nothing else.
        copies = {p.snapshot_id for p in side._parks._parks.values()} | set(side._saves._saves)
        held = {p.name.removeprefix(STAGING) for p in self.memory.iterdir()
                if p.name != ".lock"} if self.memory.exists() else set()
        assert not [h for h in held if not any(h.endswith(cid) for cid in copies)], (held, copies)

    @invariant()
    def parked_worlds_have_their_copy(self) -> None:
        """A world the group holds parked has its copy on its owner."""
        for sid, s in self.scheduler.table.items():
            if s.status in IN_PARK:
                park = self.side._parks.of(sid)
                assert park is not None and park.snapshot_id == s.park_copy.snapshot_id, (sid, park)


ENGINE = None


@pytest.mark.filterwarnings("ignore")
def test_a_world_s_life_on_its_owner_in_every_order_of_its_events(engine, monkeypatch) -> None:
    """Bounded and derandomized: the same lives on every run."""
    global ENGINE
    ENGINE = engine
    REACHED.clear()
    fake = types.SimpleNamespace(monotonic=CLOCK.monotonic, time=time.time)
    for module in (intake_module, parks_module, streams):
        monkeypatch.setattr(module, "time", fake)
    run_state_machine_as_test(OwnerLife, settings=settings(
        derandomize=True, database=None, max_examples=300, stateful_step_count=60, deadline=None,
        suppress_health_check=[HealthCheck.too_slow]))
    # The lives reach every status that outlasts a plan and every ending but a decode's failure and a key's hour.
    assert set(Status) - {Status.RETURNING, Status.ENDED} <= REACHED
    # A close (ABORTED) ends the lives that reach it on some runs only: the intake's clock is real time moved on.
    assert set(EndReason) - {EndReason.FAILED, EndReason.QUOTA, EndReason.ABORTED} <= REACHED, set(EndReason) - REACHED
