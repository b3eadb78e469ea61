"""The plan every rank's scheduler copy makes: admission and limits, fair round robin, batching by geometry,
backpressure, cancels, and the steering of steered sessions (steps, hold, end, expiry). Pure: no engine."""
from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch

from backend.api.request import Controls
from backend.engine.blocks import BlockOutput
from backend.serving.config import ServingConfig
from backend.serving.scheduler import Plan, RankEvents, Scheduler, StepEvent
from backend.serving.sessions import OwnerPart, SharedSession, State
from backend.serving.streams import SteeredStream
from factories import tiny_request


def sub(sid: str, size: int = 64) -> SharedSession:
    return SharedSession.submitted(sid, tiny_request(num_frames=9), (size, size), owner=0)


def steered(sid: str, on_starve: str = "wait") -> SharedSession:
    request = dataclasses.replace(tiny_request(num_frames=9), num_frames=None, poses=None, keys="w",
                                  on_starve=on_starve, session_key=sid)
    return SharedSession.submitted(sid, request, (64, 64), owner=0)


def step(sid: str, keys: str | None = "d", end: bool = False) -> RankEvents:
    return RankEvents(steps=[StepEvent(sid, None if keys is None else Controls(keys=keys), end)])


def deliver_all(scheduler: Scheduler) -> RankEvents:
    return RankEvents(delivered={sid: s.computed for sid, s in scheduler.table.items()})


def keys_of(plan: Plan, sid: str) -> str | None:
    controls = plan.controls[sid].controls
    return None if controls is None else controls.keys


def test_admission_limits_and_queue_rejection() -> None:
    s = Scheduler(ServingConfig(max_sessions=2, max_queue=1))
    plan = s.plan([RankEvents(submissions=[sub("a"), sub("b")]), RankEvents(submissions=[sub("c"), sub("d")])])
    assert [o.id for o in plan.opens] == ["a", "b"]
    assert [sid for sid, _ in plan.rejects] == ["d"]  # "c" waits: one queue slot
    assert "server busy" in plan.rejects[0][1] and "max_queue=1" in plan.rejects[0][1]
    assert not plan.batch  # sessions run from the round after they open
    assert s.table["c"].state is State.PENDING and s.table["a"].state is State.ACTIVE
    s.finished("a")
    assert [o.id for o in s.plan([deliver_all(s)]).opens] == ["c"]


def test_round_robin_batches_one_geometry_and_rotates() -> None:
    s = Scheduler(ServingConfig(max_sessions=8, max_batch=2, max_blocks_ahead=100))
    s.plan([RankEvents(submissions=[sub("a"), sub("b", 128), sub("c"), sub("d")])])
    batches = [s.plan([RankEvents()]).batch for _ in range(4)]
    assert batches == [["a", "c"], ["b"], ["d", "a"], ["c", "d"]]


def test_backpressure_holds_sessions_whose_client_lags() -> None:
    s = Scheduler(ServingConfig(max_blocks_ahead=2))
    s.plan([RankEvents(submissions=[sub("a")])])
    assert s.plan([RankEvents()]).batch == ["a"]
    assert s.plan([RankEvents()]).batch == ["a"]
    held = s.plan([RankEvents()])
    assert held.batch == [] and held.idle  # two blocks computed, none delivered
    assert s.plan([RankEvents(delivered={"a": 1})]).batch == ["a"]


def test_cancels_of_running_waiting_and_new_sessions() -> None:
    s = Scheduler(ServingConfig(max_sessions=1))
    s.plan([RankEvents(submissions=[sub("a"), sub("b")])])
    a = s.table["a"]
    plan = s.plan([RankEvents(submissions=[sub("c")], cancelled=["a", "b", "c"])])
    assert sorted(plan.cancels) == ["a", "b", "c"]
    assert not plan.batch and not plan.opens and not s.table and a.state is State.DONE


def test_stop_from_any_rank_stops_all() -> None:
    s = Scheduler(ServingConfig())
    assert s.plan([RankEvents(), RankEvents(stop=True)]).stop


def test_steered_session_runs_a_block_per_camera_and_waits_for_the_next() -> None:
    s = Scheduler(ServingConfig(max_blocks_ahead=100))
    s.plan([RankEvents(submissions=[steered("a")])])
    first = s.plan([RankEvents()])
    assert first.batch == ["a"] and keys_of(first, "a") == "w" and not first.controls["a"].last
    assert s.plan([RankEvents()]).idle  # on_starve=wait: no camera, no block
    nxt = s.plan([step("a", "d")])
    assert nxt.batch == ["a"] and keys_of(nxt, "a") == "d"


def test_steps_sent_early_queue_in_order() -> None:
    s = Scheduler(ServingConfig(max_blocks_ahead=100))
    s.plan([RankEvents(submissions=[steered("a")], steps=[StepEvent("a", Controls(keys="d"))]), step("a", "s")])
    assert [keys_of(s.plan([RankEvents()]), "a") for _ in range(3)] == ["w", "d", "s"]
    assert s.plan([RankEvents()]).idle


def test_hold_runs_one_block_on_the_last_motion_then_waits() -> None:
    s = Scheduler(ServingConfig(max_blocks_ahead=100))
    s.plan([RankEvents(submissions=[steered("a", on_starve="hold")])])
    assert keys_of(s.plan([RankEvents()]), "a") == "w"
    held = s.plan([RankEvents()])
    assert held.batch == ["a"] and keys_of(held, "a") is None  # the step is late: hold, one block ahead
    assert s.plan([RankEvents()]).idle  # never more than one block beyond the requests
    after = s.plan([step("a", "j")])  # that step gets the held block; its camera drives the next
    assert after.batch == ["a"] and keys_of(after, "a") == "j"


def test_end_flag_with_a_camera_makes_that_block_the_last() -> None:
    s = Scheduler(ServingConfig(max_blocks_ahead=100))
    s.plan([RankEvents(submissions=[steered("a", on_starve="hold")])])
    s.plan([RankEvents()])
    ending = s.plan([step("a", "d", end=True)])
    assert ending.batch == ["a"] and ending.controls["a"].last and s.table["a"].state is State.ENDING
    assert s.plan([RankEvents()]).idle  # an ending session never holds


def test_end_flag_alone_ends_at_once_and_frees_the_slot() -> None:
    s = Scheduler(ServingConfig(max_sessions=1, max_blocks_ahead=100))
    s.plan([RankEvents(submissions=[steered("a"), steered("b")])])
    a = s.table["a"]
    s.plan([RankEvents()])  # a runs its first block; b waits for a slot
    plan = s.plan([step("a", None, end=True)])
    assert plan.ends == ["a"] and a.state is State.DONE and [o.id for o in plan.opens] == ["b"]


def test_a_waiting_session_ended_with_queued_steps_runs_them_once_open() -> None:
    s = Scheduler(ServingConfig(max_sessions=1, max_blocks_ahead=100))
    s.plan([RankEvents(submissions=[sub("a"), steered("b")])])
    s.plan([step("b", "d", end=True)])  # b still waits for a slot, with two cameras and the end flag
    s.finished("a")
    assert [o.id for o in s.plan([RankEvents()]).opens] == ["b"]
    assert [(keys_of(p, "b"), p.controls["b"].last) for p in (s.plan([RankEvents()]), s.plan([RankEvents()]))] \
        == [("w", False), ("d", True)]


class Answered:
    """A request's reply channel that only records its block."""

    def __init__(self) -> None:
        self.blocks: list[int] = []

    def send_block(self, output: BlockOutput, frames: np.ndarray, decode_ms: float, final: bool) -> None:
        self.blocks.append(output.block_index)

    def send_error(self, message: str) -> None:
        raise AssertionError(message)

    def finish(self) -> None:
        pass

    def is_cancelled(self) -> bool:
        return False


def block(index: int) -> BlockOutput:
    return BlockOutput("a", index, 0, torch.zeros(1), 0.0, 0)


def test_owner_clock_decides_expiry_and_every_scheduler_ends_it() -> None:
    """The idle clock runs only while the server waits on the client (every request answered)."""
    settings = ServingConfig(session_idle_timeout_s=60, max_session_s=100)
    stream = SteeredStream(Answered(), on_delivered=lambda: None)
    owner = OwnerPart(stream=stream, key="7", started_s=time.monotonic())
    far = owner.started_s + 99.0  # past the idle limit, within the lifetime
    assert owner.deadline(settings) == owner.started_s + 100.0 and owner.expiry(settings, far) is None
    stream.send_block(block(0), np.zeros(1), 0.0, True)  # answered: now the server waits on the client
    answered = stream.waits_on_client_since()
    assert answered is not None and owner.deadline(settings) == answered + 60.0
    assert "session_idle_timeout_s=60 s" in owner.expiry(settings, answered + 60.0)
    stream.add(Answered(), end=False)  # a step waits for its block (behind a long one, say): no idle clock
    assert owner.expiry(settings, answered + 90.0) is None
    assert "max_session_s=100 s" in owner.expiry(settings, owner.started_s + 100.0)
    s = Scheduler(settings)
    s.plan([RankEvents(submissions=[steered("a")])])
    plan = s.plan([RankEvents(expired=[("a", "why"), ("gone", "why")])])
    assert plan.expired == [("a", "why")] and not plan.batch and not s.table
