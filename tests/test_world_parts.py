"""The parts a played world (client/world.py) is made of, each at its own boundary: the save schedule, the stall
clock, the replay check, the base and the resumes. test_played_world.py plays whole worlds against a stand-in
server."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from backend.api.codec import BlockResponse, BlockUsed, SnapshotNotice
from backend.api.request import Controls
from client.stream import StreamError
from client.world_failover import Base, Failover, Played, Resumer, WorldLostError
from client.world_replay import ReplayCheck
from client.world_saves import Saved, SaveSchedule, Step
from client.world_stall import StallClock

pytestmark = pytest.mark.timeout(30)

ID_A, ID_B, ID_C, ID_D = (c * 32 for c in "abcd")
STORE_FULL = StreamError("x", "[SNAPSHOT_STORE_FULL retry_after_s=5] the store is full")
NO_STORE = StreamError("x", "[INVALID_INPUT] this server keeps no snapshots: request parameter 'save' needs one")


def block(index: int, latents_sha256: str = "0" * 64, arrival_s: float = 0.0) -> BlockResponse:
    used = BlockUsed(np.tile(np.eye(4, dtype=np.float32), (12, 1, 1)), "a street", latents_sha256)
    return BlockResponse(index, 0, None, np.zeros((0, 0, 0, 3), np.uint8), (), arrival_s, False, used)


# The save schedule.


def saved_after(saves: SaveSchedule, block_index: int, snapshot_id: str) -> Saved | None:
    """A save sent on the step of block_index, its block come, then its outcome told (as the server tells it)."""
    step = Step(Controls(keys="w"))
    saves.send(step, block_index)
    assert saves.came(step, block_index) is None  # its outcome is not told yet
    return saves.told(SnapshotNotice(snapshot_id))


def test_a_save_is_due_every_n_blocks_one_at_a_time_and_settles_once_its_block_came_and_its_outcome_was_told() -> None:
    told: list[Saved] = []
    saves = SaveSchedule(3, told.append)
    assert [b for b in range(6) if saves.due(b)] == [2, 3, 4, 5]  # from block 2 (3 blocks after none) until one goes
    step = Step(Controls(keys="w"))
    assert saves.send(step, 2) == ""
    assert not saves.due(3) and saves.under_way and saves.waits_for_block
    assert saves.told(SnapshotNotice(ID_A)) is None and saves.waits_for_block  # told before its block came
    assert saves.came(Step(Controls(keys="w")), 2) is None  # another step's block
    saved = saves.came(step, 2)
    assert saved == Saved(ID_A, 2, asked=False) and not saves.under_way
    assert [b for b in range(3, 7) if saves.due(b)] == [5, 6]  # 3 blocks after the last
    assert told == []
    saves.tell()
    assert told == [saved]


def test_a_save_asked_for_goes_on_the_next_step_and_is_never_released() -> None:
    saves = SaveSchedule(0, None)
    assert not saves.due(5)
    saves.ask()
    assert saves.due(0)
    assert saved_after(saves, 0, ID_A) == Saved(ID_A, 0, asked=True)
    assert not saves.due(1)
    for block_index, snapshot_id in [(1, ID_B), (2, ID_C)]:
        saves.ask()
        assert saved_after(saves, block_index, snapshot_id).released == ""


def test_each_periodic_save_releases_the_periodic_snapshot_before_the_base_once_it_is_durable() -> None:
    saves = SaveSchedule(1, None)
    first, second = saved_after(saves, 0, ID_A), saved_after(saves, 1, ID_B)
    assert first.released == second.released == ""
    step = Step(Controls(keys="w"))
    assert saves.send(step, 2) == ID_A
    saves.came(step, 2)
    assert saves.told(SnapshotNotice(ID_C)).released == ID_A
    assert saves.send(Step(Controls(keys="w")), 3) == ID_B  # ID_A is gone from those kept


def test_a_save_whose_write_failed_releases_nothing_and_is_no_base() -> None:
    saves = SaveSchedule(1, None)
    saved_after(saves, 0, ID_A)
    saved_after(saves, 1, ID_B)
    step = Step(Controls(keys="w"))
    saves.send(step, 2)
    saves.came(step, 2)
    failed = saves.told(SnapshotNotice(ID_C, "[SNAPSHOT_SAVE_FAILED] the disk is full"))
    assert failed.error is not None and failed.released == ""
    assert saves.send(Step(Controls(keys="w")), 3) == ID_A  # still kept: the failed save released nothing


def test_a_save_refused_by_a_full_store_returns_its_step_and_saves_go_on_but_a_server_without_a_store_gets_no_more(
) -> None:
    told: list[Saved] = []
    saves = SaveSchedule(2, told.append)
    step = Step(Controls(keys="w"))
    saves.send(step, 1)
    assert saves.refused(STORE_FULL) is step and not saves.under_way
    assert saves.due(3)
    saves.send(step, 3)
    saves.refused(NO_STORE)
    assert not any(saves.due(b) for b in range(4, 20))
    saves.tell()
    assert [(s.snapshot_id, s.block_index, s.error) for s in told] == [
        (None, None, "the store is full"), (None, None, NO_STORE.sentence)]


def test_a_save_lost_with_its_stream_is_asked_again_on_the_next_step_and_none_goes_before_the_base_is_known() -> None:
    saves = SaveSchedule(4, None)
    saves.ask()
    saves.send(Step(Controls(keys="w")), 6)
    saves.lost(3)  # the base follows block 3
    assert not saves.under_way and saves.due(4)  # asked for: on the next step
    periodic = SaveSchedule(4, None)
    periodic.send(Step(Controls(keys="w")), 6)
    periodic.lost(3)
    assert [b for b in range(4, 9) if periodic.due(b)] == [7, 8]  # counted from the base again
    periodic.based(None)  # a caller's snapshot, its block not known yet
    periodic.ask()
    assert not periodic.due(10)
    periodic.based(9)
    assert periodic.due(10)


# The stall clock.


def test_no_stall_bound_until_a_block_time_is_measured_nor_while_no_request_waits() -> None:
    clock = StallClock(floor_s=2.0, blocks=4, samples=8)
    assert clock.stall_at(10.0) is None
    assert clock.block(arrival_s=1.0, sent_s=0.0)  # the session's first: its time is no block time
    assert clock.stall_at(10.0) is None
    assert not clock.block(arrival_s=1.5, sent_s=1.2)
    assert clock.stall_at(None) is None
    assert clock.stall_at(10.0) == pytest.approx(12.0)  # the floor: 4 x 0.3 s is less


def test_the_bound_is_blocks_times_the_longest_of_the_last_samples_and_a_first_block_adds_the_longest_first() -> None:
    clock = StallClock(floor_s=0.1, blocks=4, samples=2)
    clock.block(arrival_s=3.0, sent_s=0.0)  # a first block of 3 s
    for arrival, sent in [(4.0, 3.0), (4.5, 4.2), (4.7, 4.5)]:  # 1 s, 0.3 s, 0.2 s
        clock.block(arrival, sent)
    assert clock.bound_s() == pytest.approx(4 * 0.3)  # the 1 s block is older than the last two
    assert clock.stall_at(5.0) == pytest.approx(5.0 + 1.2)  # counted from the request's send
    clock.restart()
    assert clock.first_pending and clock.bound_s() == pytest.approx(1.2 + 3.0)


def test_a_place_in_the_queue_or_a_save_s_outcome_is_a_sign_of_life_and_a_block_s_time_runs_from_a_place_in_the_queue() -> None:
    clock = StallClock(floor_s=1.0, blocks=4, samples=8)
    clock.block(arrival_s=0.5, sent_s=0.0)
    clock.block(arrival_s=1.2, sent_s=1.0)
    assert clock.stall_at(2.0) == pytest.approx(3.0)
    clock.heard(2.5, paced=False)  # a save's outcome
    assert clock.stall_at(2.0) == pytest.approx(3.5)
    clock.heard(2.25, paced=True)  # a place in the queue that came before it: the later one counts
    assert clock.stall_at(2.0) == pytest.approx(3.5)
    clock.block(arrival_s=2.75, sent_s=2.0)  # 0.5 s from the place in the queue, not 0.75 s from its send
    assert clock.bound_s() == pytest.approx(2.0)
    clock.restart()  # a new session: what the old one heard is no sign of its life; its first block adds 0.5 s
    assert clock.stall_at(2.6) == pytest.approx(2.6 + 2.0 + 0.5)


# The replay check.


def test_a_block_made_again_is_checked_bit_for_bit_strict_or_counted() -> None:
    check = ReplayCheck(strict=False)
    assert not check.pending
    check.expect(["a" * 64, "b" * 64])
    assert check.pending and check.check(block(4, "a" * 64)) is None
    assert check.check(block(5, "c" * 64)) == "c" * 64 and not check.pending
    strict = ReplayCheck(strict=True)
    strict.expect(["a" * 64])
    with pytest.raises(WorldLostError, match="block 4 made again after the resume differs"):
        strict.check(block(4, "c" * 64))


# The base and the resumes.


def test_a_durable_save_or_a_moved_snapshot_is_the_base_with_only_the_blocks_after_it() -> None:
    base = Base(request=None)
    for index in range(4):
        base.add(Played(index, Controls(keys="w"), str(index) * 64))
    base.saved(Saved(ID_A, 1, asked=False, error="[SNAPSHOT_SAVE_FAILED] the disk is full"))
    assert base.snapshot_id is None and len(base.played) == 4
    base.saved(Saved(ID_A, 1, asked=False))
    assert (base.snapshot_id, base.block, [p.index for p in base.played]) == (ID_A, 1, [2, 3])
    base.differed(3, "f" * 64)
    assert base.played[1].latents_sha256 == "f" * 64
    base.moved(ID_B, 3)
    assert (base.snapshot_id, base.block, base.played) == (ID_B, 3, [])


def test_a_session_s_first_block_follows_the_base_and_tells_which_block_a_caller_s_snapshot_follows() -> None:
    resumed = Base(snapshot_id=ID_A, fork_seed=7)
    assert resumed.block is None and resumed.first_block(12) and resumed.block == 11
    assert not resumed.first_block(12)
    with pytest.raises(WorldLostError, match="resumed at block 14, not at block 12"):
        resumed.first_block(14)


class Waits(threading.Event):
    """A closed-event that records each wait and returns at once (set: the world was closed)."""

    def __init__(self) -> None:
        super().__init__()
        self.waited: list[float] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.waited.append(timeout)
        return self.is_set()


def test_a_failover_is_told_when_lost_and_when_through_its_resumes_tried_again_with_a_doubling_backoff() -> None:
    told: list[Failover] = []
    resumer = Resumer(within_s=60.0, retry_first_s=0.25, retry_most_s=1.0, on_failover=told.append)
    base = Base(snapshot_id=ID_A)
    base.moved(ID_A, 5)
    base.add(Played(6, Controls(keys="w"), "0" * 64))
    resumer.lost("the stream failed", base, resent=2)
    assert resumer.under_way and told == [Failover("the stream failed", 6, ID_A, replayed=1, resent=2)]
    closed = Waits()
    for _ in range(4):
        resumer.again("not ready", closed)
    assert closed.waited == [0.25, 0.5, 1.0, 1.0]
    resumer.differed()
    resumer.through(time.perf_counter())
    done = told[-1]
    assert not resumer.under_way and resumer.failovers == [done]
    assert (done.attempts, done.differed, done.resume_block) == (5, 1, 6) and done.took_s >= 0
    resumer.through(arrival_s=1.0)  # none under way: nothing told
    assert len(told) == 2


def test_a_resume_that_does_not_take_within_the_bound_loses_the_world_and_a_closed_world_stops_trying() -> None:
    resumer = Resumer(within_s=0.0, retry_first_s=0.25, retry_most_s=1.0, on_failover=None)
    resumer.lost("the stream failed", Base(), resent=0)
    with pytest.raises(WorldLostError, match="could not be resumed within 0 s: not ready"):
        resumer.again("not ready", Waits())
    patient = Resumer(within_s=60.0, retry_first_s=0.25, retry_most_s=1.0, on_failover=None)
    patient.lost("the stream failed", Base(), resent=0)
    closed = Waits()
    closed.set()
    with pytest.raises(StreamError, match="the world was closed"):
        patient.again("not ready", closed)
