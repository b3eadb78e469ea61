"""Rank 0's plan: admission and limits, fair round robin, batching by geometry, backpressure, cancels."""
from __future__ import annotations

from backend.serving.config import ServingConfig
from backend.serving.scheduler import RankEvents, Scheduler, Submission
from factories import tiny_request


def sub(sid: str, size: int = 64) -> Submission:
    return Submission(sid, tiny_request(num_frames=9), (size, size))


def deliver_all(scheduler: Scheduler) -> RankEvents:
    return RankEvents(delivered=dict(scheduler.computed))


def test_admission_limits_and_queue_rejection() -> None:
    s = Scheduler(ServingConfig(max_sessions=2, max_queue=1))
    plan = s.plan([RankEvents(submissions=[sub("a"), sub("b")]), RankEvents(submissions=[sub("c"), sub("d")])])
    assert [o.session_id for o in plan.opens] == ["a", "b"]
    assert [sid for sid, _ in plan.rejects] == ["d"]  # "c" waits: one queue slot
    assert "server busy" in plan.rejects[0][1] and "max_queue=1" in plan.rejects[0][1]
    assert not plan.batch  # sessions run from the round after they open
    s.finished("a")
    assert [o.session_id for o in s.plan([deliver_all(s)]).opens] == ["c"]


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
    plan = s.plan([RankEvents(submissions=[sub("c")], cancelled=["a", "b", "c"])])
    assert sorted(plan.cancels) == ["a", "b", "c"]
    assert not plan.batch and not plan.opens and not s.active and not s.pending


def test_stop_from_any_rank_stops_all() -> None:
    s = Scheduler(ServingConfig())
    assert s.plan([RankEvents(), RankEvents(stop=True)]).stop
