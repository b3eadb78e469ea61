"""The plan every rank's scheduler copy makes: admission and limits, fair round robin, batching by geometry,
backpressure, cancels, and the steering of steered sessions (steps, hold, end, expiry). Pure: no engine."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from backend.api.contract import CAPACITY_EXHAUSTED
from backend.api.contract import EXPIRED as EXPIRED_CODE
from backend.api.refusal import Refusal
from backend.api.request import Controls
from backend.engine.blocks import BlockOutput
from backend.serving.settings import ServingSettings
from backend.engine.geometry import VideoGeometry
from backend.serving.waits import MAX_RETRY_S, UNKNOWN_WAIT_S, UNMEASURED_RETRY_S, Average, Clocks, QueueCounts, \
    queue_waits, retry_after_s, slot_waits
from backend.serving import streams
from backend.serving.keys import ANONYMOUS, Principal, Quota
from backend.serving.news import Park, Parked, RankEvents, StepEvent
from backend.serving.scheduler import Plan, Scheduler
from backend.serving.sessions import EndReason, Ending, OwnerPart, ResumeFrom, SharedSession, Status, Step, Tier
from backend.serving.streams import SteeredStream
from factories import tiny_request

CANCELLED, ENDED, EXPIRED, FINISHED, REJECTED = (EndReason.CANCELLED, EndReason.ENDED, EndReason.EXPIRED,
                                                 EndReason.FINISHED, EndReason.REJECTED)


def geometry(size: int = 64, blocks: int = 1) -> VideoGeometry:
    """What admission resolves (the tiny model's sizes; only block_shape and num_blocks matter here)."""
    return VideoGeometry(size, size, size // 8, size // 8, size // 16, size // 16, 3, 3 * blocks, 1)


def sub(sid: str, size: int = 64, blocks: int = 100) -> SharedSession:
    return SharedSession.submitted(sid, tiny_request(num_frames=9), geometry(size, blocks), owner=0)


def steered(sid: str, on_starve: str = "wait", max_blocks: int = 0) -> SharedSession:
    request = dataclasses.replace(tiny_request(num_frames=9), num_frames=None, poses=None, keys="w",
                                  on_starve=on_starve, sequence_id=sid, max_blocks=max_blocks)
    return SharedSession.submitted(sid, request, geometry(), owner=0)


def resumed(sid: str, made: int, on_starve: str = "wait", max_blocks: int = 0) -> SharedSession:
    """A steered session resumed from its snapshot after its first `made` blocks, on a "w" step."""
    snapshot = ResumeFrom("ab" * 16, "{}", made)
    return SharedSession.resumed(sid, steered(sid, on_starve, max_blocks).request, geometry(), 0, ANONYMOUS, snapshot,
                                 Step(Controls(keys="w")))


def step(sid: str, keys: str | None = "d", end: bool = False) -> RankEvents:
    return RankEvents(steps=[StepEvent(sid, None if keys is None else Controls(keys=keys), end)])


def deliver_all(scheduler: Scheduler) -> RankEvents:
    return RankEvents(delivered={sid: s.computed for sid, s in scheduler.table.items()})


def keys_of(plan: Plan, sid: str) -> str | None:
    controls = plan.controls[sid].controls
    return None if controls is None else controls.keys


def test_admission_limits_and_queue_rejection() -> None:
    s = Scheduler(ServingSettings(max_sessions=2, max_queue=1))
    plan = s.plan([RankEvents(submissions=[sub("a"), sub("b")]), RankEvents(submissions=[sub("c"), sub("d")])])
    assert [o.id for o in plan.opens] == ["a", "b"]
    assert plan.ended_by(REJECTED) == ["d"]  # "c" waits: one queue slot
    (_, rejected), = plan.ended
    assert rejected.error.code == CAPACITY_EXHAUSTED and "max_queue=1" in rejected.error.sentence
    assert not plan.batch  # sessions run from the round after they open
    assert s.table["c"].status is Status.WAITING_SLOT and s.table["a"].status is Status.RUNNING
    assert [o.id for o in s.plan([RankEvents(cancelled=["a"])]).opens] == ["c"]


def test_round_robin_batches_one_geometry_and_rotates() -> None:
    s = Scheduler(ServingSettings(max_sessions=8, max_batch=2, max_blocks_ahead=100))
    s.plan([RankEvents(submissions=[sub("a"), sub("b", 128), sub("c"), sub("d")])])
    batches = [s.plan([RankEvents()]).batch for _ in range(4)]
    assert batches == [["a", "c"], ["b"], ["d", "a"], ["c", "d"]]


def test_backpressure_holds_sessions_whose_client_lags() -> None:
    s = Scheduler(ServingSettings(max_blocks_ahead=2))
    s.plan([RankEvents(submissions=[sub("a")])])
    assert s.plan([RankEvents()]).batch == ["a"]
    assert s.plan([RankEvents()]).batch == ["a"]
    held = s.plan([RankEvents()])
    assert held.batch == [] and held.idle  # two blocks computed, none delivered
    assert s.plan([RankEvents(delivered={"a": 1})]).batch == ["a"]


def test_cancels_of_running_waiting_and_new_sessions() -> None:
    s = Scheduler(ServingSettings(max_sessions=1))
    s.plan([RankEvents(submissions=[sub("a"), sub("b")])])
    a = s.table["a"]
    plan = s.plan([RankEvents(submissions=[sub("c")], cancelled=["a", "b", "c"])])
    assert sorted(plan.ended_by(CANCELLED)) == ["a", "b", "c"]
    assert not plan.batch and not plan.opens and not s.table
    assert a.status is Status.ENDED and a.ending == Ending(CANCELLED)


def test_stop_from_any_rank_stops_all() -> None:
    s = Scheduler(ServingSettings())
    assert s.plan([RankEvents(), RankEvents(stop=True)]).stop


def test_steered_session_runs_a_block_per_camera_and_waits_for_the_next() -> None:
    s = Scheduler(ServingSettings(max_blocks_ahead=100))
    s.plan([RankEvents(submissions=[steered("a")])])
    first = s.plan([RankEvents()])
    assert first.batch == ["a"] and keys_of(first, "a") == "w" and not first.finishing
    assert s.plan([RankEvents()]).idle  # on_starve=wait: no camera, no block
    nxt = s.plan([step("a", "d")])
    assert nxt.batch == ["a"] and keys_of(nxt, "a") == "d"


def test_steps_sent_early_queue_in_order() -> None:
    s = Scheduler(ServingSettings(max_blocks_ahead=100))
    s.plan([RankEvents(submissions=[steered("a")], steps=[StepEvent("a", Controls(keys="d"))]), step("a", "s")])
    assert [keys_of(s.plan([RankEvents()]), "a") for _ in range(3)] == ["w", "d", "s"]
    assert s.plan([RankEvents()]).idle


def test_hold_runs_one_block_on_the_last_motion_then_waits() -> None:
    s = Scheduler(ServingSettings(max_blocks_ahead=100))
    s.plan([RankEvents(submissions=[steered("a", on_starve="hold")])])
    assert keys_of(s.plan([RankEvents()]), "a") == "w"
    held = s.plan([RankEvents()])
    assert held.batch == ["a"] and keys_of(held, "a") is None  # the step is late: hold, one block ahead
    assert s.plan([RankEvents()]).idle  # never more than one block beyond the requests
    after = s.plan([step("a", "j")])  # that step gets the held block; its camera drives the next
    assert after.batch == ["a"] and keys_of(after, "a") == "j"


def test_end_flag_with_a_camera_makes_that_block_the_last() -> None:
    s = Scheduler(ServingSettings(max_blocks_ahead=100))
    s.plan([RankEvents(submissions=[steered("a", on_starve="hold")])])
    s.plan([RankEvents()])
    a = s.table["a"]
    ending = s.plan([step("a", "d", end=True)])
    assert ending.batch == ["a"] and ending.finishing == [("a", Ending(ENDED))]  # its client's end flag
    assert a.status is Status.ENDED and a.ending == Ending(ENDED)
    assert s.plan([RankEvents()]).idle and not s.table  # its slot is free once its last block is planned


def test_end_flag_alone_ends_at_once_and_frees_the_slot() -> None:
    s = Scheduler(ServingSettings(max_sessions=1, max_blocks_ahead=100))
    s.plan([RankEvents(submissions=[steered("a"), steered("b")])])
    a = s.table["a"]
    s.plan([RankEvents()])  # a runs its first block; b waits for a slot
    plan = s.plan([step("a", None, end=True)])
    assert plan.ended_by(ENDED) == ["a"] and a.ending.told().sentence == "it ended by its client"
    assert a.status is Status.ENDED and [o.id for o in plan.opens] == ["b"]


def test_a_resumed_session_counts_its_blocks_on_from_its_snapshot_up_to_its_block_limit() -> None:
    """max_blocks=5, saved after 3 blocks: two blocks are left, the second its last."""
    s = Scheduler(ServingSettings(max_blocks_ahead=100))
    s.plan([RankEvents(submissions=[resumed("a", made=3, max_blocks=5)])])
    fourth = s.plan([RankEvents()])
    assert fourth.batch == ["a"] and keys_of(fourth, "a") == "w" and not fourth.finishing
    fifth = s.plan([step("a", "d")])
    assert fifth.batch == ["a"] and fifth.finishing == [("a", Ending(FINISHED))] and not s.table


def test_a_resumed_session_on_hold_runs_one_block_beyond_its_requests_as_a_new_one_does() -> None:
    s = Scheduler(ServingSettings(max_blocks_ahead=100))
    s.plan([RankEvents(submissions=[resumed("a", made=3, on_starve="hold")])])
    assert keys_of(s.plan([RankEvents()]), "a") == "w"
    held = s.plan([RankEvents()])
    assert held.batch == ["a"] and keys_of(held, "a") is None
    assert s.plan([RankEvents()]).idle


def test_a_waiting_session_ended_with_queued_steps_runs_them_once_open() -> None:
    s = Scheduler(ServingSettings(max_sessions=1, max_blocks_ahead=100))
    s.plan([RankEvents(submissions=[sub("a"), steered("b")])])
    s.plan([step("b", "d", end=True)])  # b still waits for a slot, with two cameras and the end flag
    assert s.table["b"].status is Status.WAITING_SLOT and s.table["b"].ending == Ending(ENDED)
    assert [o.id for o in s.plan([RankEvents(cancelled=["a"])]).opens] == ["b"]
    assert [(keys_of(p, "b"), p.finishing) for p in (s.plan([RankEvents()]), s.plan([RankEvents()]))] \
        == [("w", []), ("d", [("b", Ending(ENDED))])]


def test_a_set_length_ends_with_its_last_block_and_failures_end_before_any_block() -> None:
    s = Scheduler(ServingSettings(max_blocks_ahead=100))
    s.plan([RankEvents(submissions=[sub("clip", blocks=2), steered("bounded", max_blocks=1), sub("broken")])])
    failed = Ending(REJECTED, "could not open")
    first = s.plan([RankEvents(), RankEvents(failed=[("broken", failed), ("unknown", failed)])])
    assert first.ended == [("broken", failed)] and first.batch == ["clip", "bounded"]
    assert first.finishing == [("bounded", Ending(FINISHED))]  # max_blocks=1: its set length
    second = s.plan([deliver_all(s)])
    assert second.batch == ["clip"] and second.finishing == [("clip", Ending(FINISHED))] and not s.table


class Answered:
    """A request's reply channel that only records its block."""

    def __init__(self) -> None:
        self.blocks: list[int] = []

    def send_block(self, output: BlockOutput, frames: np.ndarray, decode_ms: float, final: bool) -> None:
        self.blocks.append(output.block_index)

    def send_error(self, refusal: Refusal) -> None:
        raise AssertionError(refusal.message)

    def send_place(self, position: int, wait_s: float) -> None:
        raise AssertionError(f"a steered session with a slot told place {position}")

    def finish(self) -> None:
        pass

    def is_cancelled(self) -> bool:
        return False


def block(index: int) -> BlockOutput:
    return BlockOutput("a", index, 0, torch.zeros(1), 0.0, 0)


def test_owner_clock_decides_expiry_and_every_scheduler_ends_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The idle clock runs only while the server waits on the client (every request answered). The owner's clock
    reads whole seconds here, so each limit is tried at its very edge: near a power of two (a host up 1,000 s) a
    real clock's t + 60 - t rounds below 60."""
    clock = {"now": 1000.0}
    monkeypatch.setattr(streams, "time", SimpleNamespace(monotonic=lambda: clock["now"]))
    settings = ServingSettings(session_idle_timeout_s=60, max_session_s=100)
    stream = SteeredStream(Answered())
    owner = OwnerPart(stream=stream, sequence_id="7", started_s=clock["now"])
    far = owner.started_s + 99.0  # past the idle limit, within the lifetime
    assert owner.deadline(settings) == owner.started_s + 100.0 and owner.expiry(settings, far) is None
    clock["now"] += 1.0
    stream.send_block(block(0), np.zeros(1), 0.0, True)  # answered: now the server waits on the client
    answered = stream.waits_on_client_since()
    assert answered == clock["now"] and owner.deadline(settings) == answered + 60.0
    assert "session_idle_timeout_s=60 s" in owner.expiry(settings, answered + 60.0).sentence
    stream.add(Answered())  # a step waits for its block (behind a long one, say): no idle clock
    assert owner.expiry(settings, answered + 90.0) is None
    assert owner.expiry(settings, owner.started_s + 100.0) == Refusal(EXPIRED_CODE, "the session reached "
                                                                       "max_session_s=100 s and was ended; start a new one")
    s = Scheduler(settings)
    s.plan([RankEvents(submissions=[steered("a")])])
    plan = s.plan([RankEvents(expired=[("a", "why"), ("gone", "why")])])
    assert plan.ended == [("a", Ending(EXPIRED, "why"))] and not plan.batch and not s.table


def test_a_recache_event_runs_at_a_boundary_of_its_own_then_its_block_says_so() -> None:
    s = Scheduler(ServingSettings(max_blocks_ahead=100, max_batch=4))
    s.plan([RankEvents(submissions=[steered("a"), steered("b")])])
    s.plan([RankEvents()])  # both run their first block
    event = Controls(keys="d", prompt="it starts to snow", recache=True)
    recache = s.plan([RankEvents(steps=[StepEvent("a", event), StepEvent("b", Controls(keys="w"))])])
    assert recache.recaches == [("a", "it starts to snow")] and not recache.batch and not recache.idle
    after = s.plan([RankEvents()])  # b, which waited for the recache once, first; then a, recached
    assert after.batch == ["b", "a"] and after.controls["a"].recached and not after.controls["b"].recached
    assert after.controls["a"].controls == Controls(keys="d")  # the event has happened: its block runs plain
    assert not s.plan([RankEvents(steps=[StepEvent("a", Controls(keys="d"))])]).controls["a"].recached


def test_the_queue_waits_for_slots_in_order_and_a_refusal_for_the_place_behind_it() -> None:
    """Each waiting session takes the slot that frees first, and holds it for its own length."""
    assert slot_waits([30.0, 10.0], free=0, queued_s=[5.0, 5.0, 5.0]) == [10.0, 15.0, 20.0]
    assert slot_waits([30.0], free=1, queued_s=[8.0, 4.0]) == [0.0, 8.0]
    s = Scheduler(ServingSettings(max_sessions=2, max_queue=2, max_batch=2))
    s.plan([RankEvents(submissions=[sub("a", blocks=4), sub("b", blocks=2), sub("c", blocks=1), sub("d")])])
    clocks = Clocks()
    assert queue_waits(s, clocks, {}, 0.0) == [UNKNOWN_WAIT_S, UNKNOWN_WAIT_S]  # nothing measured yet
    clocks.batch.observe(2.0)  # a batch (both slots' sessions) takes 2 s: each holder has a block every 2 s
    # "b" frees its slot after 2 blocks (4 s), "a" after 4 (8 s); "c" takes b's and holds it 1 block (2 s)
    assert queue_waits(s, clocks, {}, 0.0, extra=1) == [4.0, 6.0, 8.0]


def test_a_drain_moves_each_playing_world_with_its_snapshot_and_ends_the_rest() -> None:
    """Draining: a session with a slot and a snapshot ends MOVED carrying the snapshot's id (its files to be written:
    plan.moves); one with no snapshot, or still in the queue, ends SERVER_STOPPING; one that ended meanwhile is left."""
    s = Scheduler(ServingSettings(max_sessions=2, max_queue=2))
    s.plan([RankEvents(submissions=[steered("a"), steered("b"), steered("c")])])
    moved = "ab" * 16
    plan = s.plan([RankEvents(moving=[("a", moved), ("b", None), ("c", moved), ("gone", moved)])])
    assert plan.moves == [("a", moved)]
    ended = {sid: ending for sid, ending in plan.ended}
    assert ended["a"].reason == EndReason.MOVED and ended["a"].error.snapshot_id == moved
    assert ended["b"].error.code == ended["c"].error.code == "SERVER_STOPPING" and set(ended) == {"a", "b", "c"}
    assert s.table == {}


def test_a_full_queue_asks_back_after_its_wait_at_most_a_minute_and_after_5_s_before_any_block() -> None:
    assert retry_after_s(UNKNOWN_WAIT_S) == UNMEASURED_RETRY_S == 5.0
    assert retry_after_s(0.25) == 0.25 and retry_after_s(59.5) == 59.5
    assert retry_after_s(MAX_RETRY_S) == retry_after_s(3600.0) == MAX_RETRY_S == 60.0


def test_the_measured_times_move_30_percent_towards_each_new_one() -> None:
    average = Average()
    assert average.value is None
    average.observe(10.0)
    assert average.value == 10.0  # the first is taken as it is
    average.observe(20.0)
    assert average.value == pytest.approx(13.0)


def test_the_queue_counts_how_far_each_playing_session_has_come() -> None:
    """A slot frees after its holder's blocks left (a clip) or its expected life less its age (open-ended), not
    after a whole session from the start: the wait told to the line and a full queue's retry time alike."""
    s = Scheduler(ServingSettings(max_sessions=2, max_queue=1, max_batch=2))
    s.plan([RankEvents(submissions=[sub("a", blocks=4), steered("b")])])
    for _ in range(2):  # both run a block, then another ("b" on its first camera, then a step's)
        s.plan([dataclasses.replace(deliver_all(s), steps=[StepEvent("b", Controls(keys="d"))])])
    s.plan([dataclasses.replace(deliver_all(s), submissions=[sub("c", blocks=1)])])  # "a" runs its 3rd: 1 left
    assert [s.table[sid].computed for sid in ("a", "b")] == [3, 3] and [w.id for w in s.waiting()] == ["c"]
    clocks = Clocks()
    clocks.batch.observe(2.0)  # a round of both slots: 2 s
    clocks.life.observe(30.0)  # open-ended sessions have lived 30 s
    opened = {"a": 0.0, "b": 0.0}
    # "a" frees its slot after its 1 block left (2 s), before "b", open 25 s of its expected 30 (5 s left).
    assert queue_waits(s, clocks, opened, 25.0, extra=1) == [2.0, 4.0]
    # At 29 s "b" is 1 s from its expected end, though never less than a round away; "a" has 1 block left (2 s).
    assert queue_waits(s, clocks, opened, 29.0, extra=1) == [2.0, 2.0]


def test_a_round_serves_every_slot_in_batches_and_a_waiting_open_ended_session_holds_its_whole_life() -> None:
    """max_batch 1 and 2 slots held: each holder has a block every 2 batches. A waiting open-ended session, once
    in a slot, holds it for the measured life of those that ended (its age there starts at 0)."""
    s = Scheduler(ServingSettings(max_sessions=2, max_queue=2, max_batch=1))
    s.plan([RankEvents(submissions=[sub("a", blocks=3), sub("b", blocks=20), steered("d")])])
    clocks = Clocks()
    clocks.batch.observe(2.0)
    clocks.life.observe(30.0)
    # A round is 2 batches (4 s): "a" frees its slot after 3 rounds (12 s), "b" after 20 (80 s); "d" takes a's
    # slot at 12 s and holds it 30 s, so the place behind it frees at 42 s.
    assert queue_waits(s, clocks, {"a": 0.0, "b": 0.0}, 0.0, extra=1) == [12.0, 42.0]


def test_the_queue_s_counts_for_the_metrics_port() -> None:
    s = Scheduler(ServingSettings(max_sessions=3, max_queue=2))
    s.plan([RankEvents(submissions=[sub("a"), steered("b"), sub("c", size=32), sub("d"), sub("e")])])
    s.plan([RankEvents(steps=[StepEvent("b", Controls(keys="d"), end=True)])])  # "b" ends after its steps
    counts = QueueCounts.of(s, s.settings, [1.5])
    assert counts == QueueCounts(pending=2, active=2, ending=1, waiting=2, free_slots=0, waited_s=[1.5])
    s.plan([RankEvents(cancelled=["d", "e", "c"])])  # and "b" runs its last step
    assert QueueCounts.of(s, s.settings, []) == QueueCounts(pending=0, active=1, ending=0, waiting=0, free_slots=2)


def test_a_save_whose_session_ended_first_is_dropped_and_told_to_its_owner() -> None:
    """A step that carries a save reaches the plan after its session ended (a drain moved it, say): its save is
    never run, so the plan drops it naming the step's rank, the owner who reserved it and tells its client; so are
    the saves of an ending session's queued steps. An owner left waiting for such a save never closed its session's
    stream, and a drain waited its whole bound for it."""
    s = Scheduler(ServingSettings(max_blocks_ahead=1))  # b's client lags after its first block: its step waits
    owned = [dataclasses.replace(steered(sid), owner=1) for sid in ("a", "b")]
    s.plan([RankEvents(), RankEvents(submissions=owned)])
    assert s.plan([RankEvents(), RankEvents(cancelled=["a"])]).batch == ["b"]
    queued = StepEvent("b", Controls(keys="d", save=True), snapshot_id="2" * 32)
    assert s.plan([RankEvents(), RankEvents(steps=[queued])]).batch == []
    late = StepEvent("a", Controls(keys="d", save=True), snapshot_id="1" * 32)
    plan = s.plan([RankEvents(), RankEvents(steps=[late], cancelled=["b"])])
    assert sorted(plan.unsaved) == [(1, "a", "1" * 32), (1, "b", "2" * 32)]


def test_a_drain_s_snapshot_of_a_session_that_ended_at_the_same_boundary_is_dropped_by_its_owner() -> None:
    """Its client went away as the group drained it: the snapshot its owner reserved for the move is told unsaved
    (its owner's end of the session waits for every save of it to be over, so its stream closes)."""
    s = Scheduler(ServingSettings())
    s.plan([RankEvents(), RankEvents(submissions=[dataclasses.replace(steered("a"), owner=1)])])
    plan = s.plan([RankEvents(), RankEvents(cancelled=["a"], moving=[("a", "1" * 32)])])
    assert plan.ended_by(CANCELLED) == ["a"] and plan.unsaved == [(1, "a", "1" * 32)] and not plan.moves


# -- parked worlds (docs/serving.md, "Parking")

def parked_world(s: Scheduler, sid: str, snapshot_id: str, tier: Tier = Tier.MEMORY, owner: int = 0) -> Plan:
    """An admitted steered world that ran its first block, parked: its Park and its copy's Parked news."""
    events = [RankEvents() for _ in range(owner + 1)]
    events[owner] = RankEvents(parking=[Park(sid, snapshot_id, tier)])
    assert [p.snapshot_id for p in s.plan(events).parks] == [snapshot_id]
    events[owner] = RankEvents(parked=[Parked(sid, snapshot_id, "{}")])
    return s.plan(events)


def test_an_idle_world_keeps_its_slot_until_its_copy_is_durable_then_leaves_it_and_returns_at_the_front() -> None:
    s = Scheduler(ServingSettings(max_sessions=1, max_queue=2))
    s.plan([RankEvents(submissions=[steered("a")])])
    s.plan([deliver_all(s)])  # "a" runs its first block
    plan = s.plan([RankEvents(parking=[Park("a", "1" * 32, Tier.MEMORY)], submissions=[steered("b")])])
    assert [p.session_id for p in plan.parks] == ["a"] and not plan.opens  # saved where it stands, on its slot
    assert s.table["a"].status is Status.PARKING and [w.id for w in s.waiting()] == ["b"]
    plan = s.plan([RankEvents(parked=[Parked("a", "1" * 32, "{}")], submissions=[steered("c")])])
    assert plan.parked == ["a"] and [o.id for o in plan.opens] == ["b"]  # its slot goes to the line
    assert s.table["a"].park_copy == ResumeFrom("1" * 32, "{}", 1, park=Tier.MEMORY) and s.table["a"].status is Status.PARKED
    assert QueueCounts.of(s, s.settings, []) == QueueCounts(1, 1, 0, 1, 0, [], parked=1)  # "c" waits
    s.plan([deliver_all(s)])  # "b" runs its first block
    plan = s.plan([step("a")])  # "a" asks for a block: the front of the line, before "c"
    assert not plan.opens and [w.id for w in s.waiting()] == ["a", "c"]
    plan = s.plan([RankEvents(parking=[Park("b", "2" * 32, Tier.DISK)])])
    plan = s.plan([dataclasses.replace(deliver_all(s), parked=[Parked("b", "2" * 32, "{}")])])
    assert plan.parked == ["b"] and [(o.id, o.resume.park) for o in plan.opens] == [("a", Tier.MEMORY)]
    assert s.plan([deliver_all(s)]).controls["a"].controls == Controls(keys="d")  # its step's block, then "c"'s turn


def test_a_park_is_refused_past_max_parked_with_a_code_and_when_the_world_plays_again_without_one() -> None:
    s = Scheduler(ServingSettings(max_sessions=3, max_parked=1))
    s.plan([RankEvents(), RankEvents(submissions=[dataclasses.replace(steered(x), owner=1) for x in "abc"])])
    s.plan([RankEvents(), deliver_all(s)])
    parked_world(s, "a", "1" * 32, owner=1)
    plan = s.plan([RankEvents(), RankEvents(parking=[Park("b", "2" * 32, Tier.MEMORY)])])
    (refused,) = plan.refused_parks
    assert refused[:3] == (1, "b", "2" * 32) and refused[3].code == CAPACITY_EXHAUSTED
    assert "max_parked=1" in refused[3].sentence and s.table["b"].status is Status.RUNNING and not plan.parks
    # A step and a park in one boundary: the world plays; a step after the copy was made: the copy is dropped.
    plan = s.plan([RankEvents(), RankEvents(steps=[StepEvent("c", Controls(keys="d"))],
                                            parking=[Park("c", "3" * 32, Tier.MEMORY)])])
    assert plan.refused_parks == [(1, "c", "3" * 32, None)] and plan.batch == ["c"]
    s.plan([RankEvents(), RankEvents(cancelled=["a"])])
    assert s.plan([RankEvents(), RankEvents(parking=[Park("c", "4" * 32, Tier.MEMORY)])]).parks
    s.plan([RankEvents(), RankEvents(steps=[StepEvent("c", Controls(keys="w"))])])
    plan = s.plan([RankEvents(), RankEvents(parked=[Parked("c", "4" * 32, "{}")])])
    assert plan.refused_parks == [(1, "c", "4" * 32, None)] and s.table["c"].status is Status.RUNNING and not plan.parked


def test_a_returning_world_does_not_hold_max_parked_against_the_idle_world_whose_slot_it_waits_for() -> None:
    """One slot, max_parked=1: "a" parked asks for a block while "b", idle, holds the slot. "b" parks (the returning
    world is leaving its copy), and once its copy is durable "a" takes its slot."""
    s = Scheduler(ServingSettings(max_sessions=1, max_parked=1))
    s.plan([RankEvents(submissions=[steered("a")])])
    s.plan([deliver_all(s)])
    assert parked_world(s, "a", "1" * 32).parked == ["a"]
    s.plan([RankEvents(submissions=[steered("b")])])
    s.plan([deliver_all(s)])  # "b" runs its first block, then asks for none
    assert not s.plan([step("a")]).opens and [w.id for w in s.waiting()] == ["a"]
    plan = s.plan([RankEvents(parking=[Park("b", "2" * 32, Tier.MEMORY)])])
    assert not plan.refused_parks and [p.session_id for p in plan.parks] == ["b"]
    plan = s.plan([RankEvents(parked=[Parked("b", "2" * 32, "{}")])])
    assert plan.parked == ["b"] and [o.id for o in plan.opens] == ["a"]
    assert QueueCounts.of(s, s.settings, []).parked == 1


def test_a_world_whose_step_meets_its_durable_copy_runs_no_block_off_its_slot() -> None:
    """"a" returns while "b" parks; "b"'s step comes with its durable copy: "b" is off its slot and "a" takes it, so
    no block of "b" runs at that boundary (its caches are freed: it waits for a slot again)."""
    s = Scheduler(ServingSettings(max_sessions=1, max_parked=1))
    s.plan([RankEvents(submissions=[steered("a")])])
    s.plan([deliver_all(s)])
    parked_world(s, "a", "1" * 32)
    s.plan([RankEvents(submissions=[steered("b")])])
    s.plan([deliver_all(s)])
    s.plan([step("a")])
    assert s.plan([RankEvents(parking=[Park("b", "2" * 32, Tier.MEMORY)])]).parks
    plan = s.plan([dataclasses.replace(step("b"), parked=[Parked("b", "2" * 32, "{}")], delivered={"b": 1})])
    assert plan.parked == ["b"] and [o.id for o in plan.opens] == ["a"] and plan.batch == []
    assert [w.id for w in s.waiting()] == ["b"] and s.table["b"].computed == 1


def test_a_parked_world_counts_against_its_keys_sessions_not_against_the_slots() -> None:
    capped = Principal("alice", "tag-a", Quota(sessions=1))
    s = Scheduler(ServingSettings(max_sessions=2))
    s.plan([RankEvents(submissions=[dataclasses.replace(steered("a"), principal=capped)])])
    s.plan([deliver_all(s)])
    parked_world(s, "a", "1" * 32)
    plan = s.plan([RankEvents(submissions=[dataclasses.replace(steered("b"), principal=capped), steered("c")])])
    assert [o.id for o in plan.opens] == ["c"] and [w.id for w in s.waiting()] == ["b"]  # alice holds her one
    assert QueueCounts.of(s, s.settings, []).free_slots == 1


def test_a_parked_world_expires_ends_and_moves_from_its_copy_when_the_group_drains() -> None:
    s = Scheduler(ServingSettings(max_sessions=3))
    s.plan([RankEvents(submissions=[steered(x) for x in "abc"])])
    s.plan([deliver_all(s)])
    for sid, tier in (("a", Tier.MEMORY), ("b", Tier.DISK), ("c", Tier.MEMORY)):
        parked_world(s, sid, sid * 32, tier)
    expired = Refusal(EXPIRED_CODE, "idle")
    plan = s.plan([RankEvents(expired=[("c", expired)])])
    assert plan.ended == [("c", Ending(EXPIRED, expired))]
    moved = "d" * 32
    plan = s.plan([RankEvents(moving=[("a", moved), ("b", "b" * 32)])])  # a copy in memory; b's own, on disk
    assert plan.copies == [(0, moved, ResumeFrom("a" * 32, "{}", 1, park=Tier.MEMORY))] and not plan.moves
    ended = dict(plan.ended)
    assert ended["a"].error.snapshot_id == moved and ended["b"].error.snapshot_id == "b" * 32 and not s.table
