"""The fair queue and the keys' quotas, as every rank's scheduler plans them: slots round-robin between keys, each
waiting session told its true place, a key's caps on sessions and places, its blocks per hour on the boundary's
clock, and a revoked key's sessions ending. Pure: no engine."""
from __future__ import annotations

import pytest

from backend.api import contract as c
from backend.serving.settings import ServingSettings
from backend.serving.fair import HOUR_S, HourlyUsage
from backend.serving.keys import Principal, Quota
from backend.serving.waits import Clocks, queue_waits
from backend.serving.news import RankEvents
from backend.serving.scheduler import Scheduler
from backend.serving.sessions import EndReason, SharedSession
from test_scheduler import geometry
from factories import tiny_request


def of(name: str, sid: str, blocks: int = 100, **limits) -> SharedSession:
    principal = Principal(name, f"tag-{name}", Quota(**limits))
    return SharedSession.submitted(sid, tiny_request(num_frames=9), geometry(blocks=blocks), owner=0,
                                   principal=principal)


def ids(sessions) -> list[str]:
    return [s.id for s in sessions]


def test_key_b_gets_the_next_free_slot_after_key_a_queued_ten() -> None:
    s = Scheduler(ServingSettings(max_sessions=2, max_queue=16))
    opened = s.plan([RankEvents(submissions=[of("A", f"a{i}") for i in range(10)])]).opens
    assert ids(opened) == ["a0", "a1"]  # A's first two take the slots; eight wait
    s.plan([RankEvents(submissions=[of("B", "b0")])])
    assert ids(s.waiting())[0] == "b0"  # its true place: first, ahead of A's eight
    assert ids(s.plan([RankEvents(cancelled=["a0"])]).opens) == ["b0"]
    assert ids(s.plan([RankEvents(cancelled=["a1"])]).opens) == ["a2"]  # then A again, oldest first


def test_slots_alternate_between_keys_and_each_waiting_session_knows_its_place() -> None:
    s = Scheduler(ServingSettings(max_sessions=1, max_queue=16))
    s.plan([RankEvents(submissions=[of("C", "c0")])])  # holds the one slot
    s.plan([RankEvents(submissions=[of("A", "a0"), of("A", "a1"), of("A", "a2"), of("B", "b0"), of("B", "b1")])])
    line = ids(s.waiting())
    assert line == ["a0", "b0", "a1", "b1", "a2"]  # round robin, oldest first within a key
    served = []
    for sid in ["c0", *line]:
        served += ids(s.plan([RankEvents(cancelled=[sid])]).opens)
    assert served == line  # the places told were the true order


def test_a_key_whose_sessions_all_ended_counts_as_not_served_recently() -> None:
    """B was served before A, but A's sessions all ended since: A's next session goes first, B's waiting longer."""
    s = Scheduler(ServingSettings(max_sessions=2, max_queue=8))
    s.plan([RankEvents(submissions=[of("B", "b0")])])
    s.plan([RankEvents(submissions=[of("A", "a0"), of("C", "c0")])])  # a0 takes the other slot, c0 waits
    assert ids(s.plan([RankEvents(cancelled=["a0"])]).opens) == ["c0"]  # A has no session left
    s.plan([RankEvents(submissions=[of("B", "b1"), of("A", "a1")])])
    assert ids(s.waiting()) == ["a1", "b1"]
    assert ids(s.plan([RankEvents(cancelled=["c0"])]).opens) == ["a1"]


def test_without_keys_the_queue_is_first_come_first_served() -> None:
    s = Scheduler(ServingSettings(max_sessions=1, max_queue=8))
    s.plan([RankEvents(submissions=[of("", f"s{i}") for i in range(4)])])
    assert ids(s.waiting()) == ["s1", "s2", "s3"]


def test_a_key_at_its_session_cap_waits_for_its_own_while_another_key_is_served_at_once() -> None:
    s = Scheduler(ServingSettings(max_sessions=4, max_queue=8))
    plan = s.plan([RankEvents(submissions=[of("A", f"a{i}", sessions=2, queue=1) for i in range(4)])])
    assert ids(plan.opens) == ["a0", "a1"]  # its cap, though two slots are free
    (sid, ending), = plan.ended  # a3: past sessions + queue
    assert sid == "a3" and ending.error.code == c.USER_SESSION_LIMIT and "sessions=2, queue=1" in ending.error.sentence
    assert ids(s.plan([RankEvents(submissions=[of("B", "b0")])]).opens) == ["b0"]  # served at once
    assert ids(s.waiting()) == ["a2"]
    assert ids(s.plan([RankEvents(cancelled=["b0"])]).opens) == []  # a free slot, but A is at its cap
    assert ids(s.plan([RankEvents(cancelled=["a0"])]).opens) == ["a2"]


def test_a_capped_keys_place_counts_the_sessions_that_overtake_it() -> None:
    s = Scheduler(ServingSettings(max_sessions=2, max_queue=8))
    s.plan([RankEvents(submissions=[of("A", "a0", sessions=1), of("C", "c0")])])
    s.plan([RankEvents(submissions=[of("A", "a1", sessions=1), of("B", "b0"), of("B", "b1")])])
    # a0 frees first in the round robin's order: B (never served) takes it, A (served before C) the next; A's a1
    # waits for its own a0 whichever frees first.
    assert ids(s.waiting()) == ["b0", "a1", "b1"]
    assert ids(s.plan([RankEvents(cancelled=["c0"])]).opens) == ["b0"]


def test_a_free_slot_no_key_may_take_waits_and_each_release_counts_once() -> None:
    """Keys C and B at their cap of one, one slot free: nobody waiting may take it. The places told follow what
    frees each key's slot: C's running session ends first (c0), then B's (b1), then c0 itself (c2), so C's second
    session does not overtake B's."""
    s = Scheduler(ServingSettings(max_sessions=3, max_queue=8))
    assert ids(s.plan([RankEvents(submissions=[of("C", "cr", sessions=1), of("B", "br", sessions=1)])]).opens) == \
        ["cr", "br"]
    plan = s.plan([RankEvents(submissions=[of("C", "c0", sessions=1), of("B", "b1", sessions=1),
                                           of("C", "c2", sessions=1)])])
    assert ids(plan.opens) == [] and ids(s.waiting()) == ["c0", "b1", "c2"]
    served = []
    for sid in ("cr", "br", "c0"):
        served += ids(s.plan([RankEvents(cancelled=[sid])]).opens)
    assert served == ["c0", "b1", "c2"]


def test_each_slot_that_frees_seats_one_waiting_session() -> None:
    """The queue full (C's and B's sessions hold both slots), B at its cap of one, C at two: C's first waiting session
    gets the first slot that frees; the next goes to B (not served since), C's second waits for a third."""
    s = Scheduler(ServingSettings(max_sessions=2, max_queue=8))
    s.plan([RankEvents(submissions=[of("C", "cr", sessions=2), of("B", "br", sessions=1)])])
    s.plan([RankEvents(submissions=[of("B", "b0", sessions=1), of("C", "c1", sessions=2),
                                    of("C", "c2", sessions=2)])])
    assert ids(s.waiting()) == ["c1", "b0", "c2"]
    served = []
    for sid in ("cr", "br", "c1"):
        served += ids(s.plan([RankEvents(cancelled=[sid])]).opens)
    assert served == ["c1", "b0", "c2"]


def test_the_queue_waits_follow_the_fair_order() -> None:
    s = Scheduler(ServingSettings(max_sessions=1, max_queue=8))
    s.plan([RankEvents(submissions=[of("A", "a0", blocks=2)])])
    s.plan([RankEvents(submissions=[of("A", f"a{i}", blocks=2) for i in (1, 2)] + [of("B", "b0", blocks=2)])])
    clocks = Clocks()
    clocks.batch.observe(2.0)  # a0 has one block left (2 s); each waiting session holds its slot for two (4 s)
    assert ids(s.waiting()) == ["b0", "a1", "a2"]
    assert queue_waits(s, clocks, {}, 0.0) == [2.0, 6.0, 10.0]


def test_blocks_per_hour_ends_a_running_session_and_refuses_new_ones_until_blocks_age_out() -> None:
    s = Scheduler(ServingSettings(max_sessions=4, max_blocks_ahead=100))
    s.plan([RankEvents(submissions=[of("A", "a0", blocks_per_hour=3), of("B", "b0")], clock_s=1000.0)])
    batches = [s.plan([RankEvents(clock_s=1000.0 + 10 * i)]) for i in range(1, 5)]
    assert [p.batch for p in batches[:3]] == [["a0", "b0"]] * 3
    (sid, ending), = batches[3].ended  # its fourth block is over the quota: it ends, B runs on
    assert sid == "a0" and ending.reason is EndReason.QUOTA and ending.error.code == c.QUOTA_EXHAUSTED
    assert ending.error.retry_after_s == pytest.approx(1010.0 + HOUR_S - 1040.0)  # the first block ages out
    assert batches[3].batch == ["b0"]
    refused = s.plan([RankEvents(submissions=[of("A", "a1", blocks_per_hour=3)], clock_s=1100.0)])
    assert refused.ended[0][1].error.code == c.QUOTA_EXHAUSTED and not refused.opens
    later = s.plan([RankEvents(submissions=[of("A", "a2", blocks_per_hour=3)], clock_s=1010.0 + HOUR_S)])
    assert ids(later.opens) == ["a2"]


def test_a_batch_never_takes_a_key_past_its_quota() -> None:
    s = Scheduler(ServingSettings(max_sessions=4, max_batch=4, max_blocks_ahead=100))
    s.plan([RankEvents(submissions=[of("A", f"a{i}", blocks_per_hour=2) for i in range(3)], clock_s=5.0)])
    plan = s.plan([RankEvents(clock_s=6.0)])
    assert plan.batch == ["a0", "a1"] and plan.ended_by(EndReason.QUOTA) == ["a2"]


def test_each_block_of_a_batch_counts_towards_its_keys_quota() -> None:
    """A key's two sessions batched together: its 4 blocks an hour are two batches, and both sessions then end."""
    s = Scheduler(ServingSettings(max_sessions=4, max_batch=2, max_blocks_ahead=100))
    s.plan([RankEvents(submissions=[of("A", f"a{i}", blocks_per_hour=4) for i in range(2)], clock_s=0.0)])
    plans = [s.plan([RankEvents(clock_s=t)]) for t in (1.0, 2.0, 3.0)]
    assert [p.batch for p in plans] == [["a0", "a1"], ["a0", "a1"], []]
    assert plans[2].ended_by(EndReason.QUOTA) == ["a0", "a1"] and not s.table
    (_, ending), _ = plans[2].ended
    assert ending.error.retry_after_s == pytest.approx(1.0 + HOUR_S - 3.0)  # when the first batch's two age out


def test_the_boundary_clock_is_the_latest_rank_clock_and_never_goes_back() -> None:
    s = Scheduler(ServingSettings())
    s.plan([RankEvents(clock_s=50.0), RankEvents(clock_s=70.0)])
    s.plan([RankEvents(clock_s=60.0)])
    assert s.now == 70.0


def test_a_revoked_keys_sessions_end_running_and_waiting_on_every_rank_alike() -> None:
    ranks = [Scheduler(ServingSettings(max_sessions=1, max_queue=4)) for _ in range(2)]
    for s in ranks:  # each rank its own copy, as unpickled from the events
        s.plan([RankEvents(submissions=[of("A", "a0"), of("B", "b0"), of("A", "a1")])])
    plans = [s.plan([RankEvents(), RankEvents(revoked=["tag-A"])]) for s in ranks]
    for plan in plans:
        assert sorted(plan.ended_by(EndReason.REVOKED)) == ["a0", "a1"]
        assert plan.ended[0][1].error.code == c.AUTH_INVALID and "revoked" in plan.ended[0][1].error.sentence
        assert ids(plan.opens) == ["b0"]


def test_the_hourly_usage_ages_blocks_out_and_forgets_idle_keys() -> None:
    usage = HourlyUsage()
    usage.add("A", 0.0, 2)
    usage.add("A", 100.0, 1)
    assert usage.used("A", 100.0) == 3
    assert usage.retry_after_s("A", 2, 100.0) == HOUR_S - 100.0  # two must age out: the first entry holds both
    assert usage.used("A", HOUR_S + 1.0) == 1
    usage.forget(["A"], 2 * HOUR_S)
    assert usage.entries == {}


def test_blocks_at_one_boundary_time_add_up_and_a_key_far_over_its_limit_waits_for_enough_to_age_out() -> None:
    usage = HourlyUsage()
    usage.add("A", 0.0, 2)
    usage.add("A", 0.0, 1)  # another batch at the same boundary time
    usage.add("A", 100.0, 1)
    assert usage.used("A", 100.0) == 4
    # Its limit lowered to 1 (a reload, its name kept): all 4 blocks must age out, the last at 100 s + an hour.
    assert usage.retry_after_s("A", 1, 100.0) == HOUR_S
