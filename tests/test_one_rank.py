"""One rank's intake and group loop wired as a member wires them, with recording responders: streams,
per-session failures, cancellation, steered sessions' limits and pauses, its threads' torch threads and the
control plane's CPU."""
from __future__ import annotations

import dataclasses
import re
import threading

import numpy as np
import pytest
import torch

from backend.api.codec import SnapshotNotice
from backend.engine.session import Decoding
from backend.api.refusal import Refusal
from backend.api.request import Controls, StepRequest
from backend.serving.settings import ServingSettings
from one_rank import OneRank
from backend.serving.loop_cpu import LoopCpu
from backend.serving.threads import CoreSplit
from backend.engine.blocks import BlockOutput
from backend.engine.rollout import WorldModelEngine
from factories import tiny_request
from polling import wait_until


class RecordingResponder:
    def __init__(self) -> None:
        self.blocks: list[int] = []
        self.places: list[tuple[int, float]] = []
        self.notices: list[SnapshotNotice] = []
        self.error: str | None = None
        self.code: str | None = None
        self.closed = threading.Event()
        self.cancelled = False

    def send_block(self, output: BlockOutput, frames: np.ndarray, decode_ms: float, final: bool) -> None:
        self.blocks.append(output.block_index)
        if final:
            self.closed.set()

    def send_error(self, refusal: Refusal) -> None:
        self.error, self.code = refusal.sentence, refusal.code
        self.closed.set()

    def send_place(self, position: int, wait_s: float) -> None:
        self.places.append((position, wait_s))

    def send_notice(self, notice: SnapshotNotice) -> None:
        self.notices.append(notice)

    def finish(self) -> None:
        self.closed.set()

    def is_cancelled(self) -> bool:
        return self.cancelled or (self.closed.is_set() and self.error is not None)


@pytest.fixture()
def coordinator(engine: WorldModelEngine):
    failures: list[BaseException] = []
    group = OneRank(engine, ServingSettings(max_sessions=2), on_failure=failures.append)
    yield group
    group.stop()
    assert not failures, failures


def wait(responders: list[RecordingResponder], timeout: float = 60) -> None:
    for r in responders:
        assert r.closed.wait(timeout), "a stream never ended"


def test_streams_complete_in_order(coordinator: OneRank) -> None:
    responders = [RecordingResponder() for _ in range(3)]
    for seed, r in enumerate(responders):
        coordinator.submit(tiny_request(decode=False, num_frames=21, seed=seed), r)
    wait(responders)
    assert all(r.blocks == [0, 1] and r.error is None for r in responders)
    wait_until(lambda: not coordinator.sessions, 10, "the sessions to close")


def test_failed_open_errors_that_stream_only(coordinator: OneRank, monkeypatch) -> None:
    real_open = coordinator.engine.open_session

    def open_session(request, geometry, session_id=None, owner=0, **kwargs):
        if request.seed == 13:
            raise RuntimeError("CUDA out of memory (simulated)")
        if request.seed == 14:
            raise RuntimeError("a file went missing (simulated)")
        return real_open(request, geometry, session_id, owner, **kwargs)

    monkeypatch.setattr(coordinator.engine, "open_session", open_session)
    bad, broken, good = RecordingResponder(), RecordingResponder(), RecordingResponder()
    coordinator.submit(tiny_request(decode=False, num_frames=9, seed=13), bad)
    coordinator.submit(tiny_request(decode=False, num_frames=9, seed=14), broken)
    coordinator.submit(tiny_request(decode=False, num_frames=9, seed=1), good)
    wait([bad, broken, good])
    # A code to act on and a plain sentence on what to do; the exception text goes to the log only.
    assert bad.code == "OUT_OF_MEMORY" and "no memory for this video" in bad.error and "CUDA" not in bad.error
    assert broken.code == "OPEN_FAILED" and "could not start this video" in broken.error
    assert "missing" not in broken.error
    assert good.blocks == [0] and good.error is None


def test_failed_decode_ends_the_stream_and_frees_its_slot(coordinator: OneRank, monkeypatch) -> None:
    real_frames = Decoding.frames

    def frames(decoding, vae, output):
        if decoding.geometry.num_blocks > 1 and output.block_index == 1:  # the broken session's (the long one)
            raise RuntimeError("decoder broke (simulated)")
        return real_frames(decoding, vae, output)

    monkeypatch.setattr(Decoding, "frames", frames)
    broken = RecordingResponder()
    coordinator.submit(tiny_request(decode=False, num_frames=129, seed=13), broken)
    wait([broken])
    assert broken.blocks == [0] and broken.code == "DECODE_FAILED"
    assert "could not turn this block into video frames" in broken.error
    assert "decoder broke" not in broken.error
    wait_until(lambda: not coordinator.sessions, 30, "the broken session to free its slot")
    others = [RecordingResponder() for _ in range(2)]  # both slots are free again
    for seed, r in enumerate(others):
        coordinator.submit(tiny_request(decode=False, num_frames=9, seed=seed), r)
    wait(others)
    assert all(r.blocks == [0] for r in others)


def test_cancelled_stream_is_dropped(coordinator: OneRank) -> None:
    responder = RecordingResponder()
    coordinator.submit(tiny_request(decode=False, num_frames=129), responder)
    wait_until(lambda: responder.blocks, 60, "the first block")
    responder.cancelled = True
    wait([responder])
    assert len(responder.blocks) < 11 and responder.error is None
    wait_until(lambda: not coordinator.sessions, 10, "the sessions to close")


def test_loop_and_writer_run_on_their_share_of_threads_and_the_loop_reports_its_cpu(engine: WorldModelEngine,
                                                                                   monkeypatch) -> None:
    seen: dict[str, set[int]] = {"dit": set(), "decode": set()}
    real_run, real_frames = engine.run_block, Decoding.frames

    def run_block(sessions, controls=None):
        seen["dit"].add(torch.get_num_threads())
        return real_run(sessions, controls)

    def frames(decoding, vae, output):
        seen["decode"].add(torch.get_num_threads())
        return real_frames(decoding, vae, output)

    monkeypatch.setattr(engine, "run_block", run_block)
    monkeypatch.setattr(Decoding, "frames", frames)
    reports: list[tuple[float, int]] = []
    failures: list[BaseException] = []
    before = torch.get_num_threads()
    group = OneRank(engine, ServingSettings(max_sessions=2), on_failure=failures.append,
                             threads=CoreSplit(dit=1, decode=2), cpu=LoopCpu(lambda s, n: reports.append((s, n))))
    try:
        responder = RecordingResponder()
        group.submit(tiny_request(decode=True, num_frames=21), responder)
        wait([responder])
    finally:
        group.stop()
        torch.set_num_threads(before)  # torch's count is also the default of threads that start later
    assert not failures and responder.blocks == [0, 1] and seen == {"dit": {1}, "decode": {2}}
    assert [n for _, n in reports] == [1, 1] and all(0.0 <= s < 5.0 for s, _ in reports) and reports[0][0] > 0.0


@pytest.mark.parametrize(("cores", "dit", "decode"), [(1, 1, 1), (2, 1, 1), (3, 1, 2), (16, 8, 8)])
def test_core_split_adds_up_to_the_instance_cores(cores: int, dit: int, decode: int) -> None:
    assert CoreSplit.of(cores) == CoreSplit(dit=dit, decode=decode)


def steered_request(**overrides):
    return dataclasses.replace(tiny_request(decode=False, num_frames=9), num_frames=None, poses=None, keys="w",
                               sequence_id="7", **overrides)


@pytest.fixture()
def counted(engine: WorldModelEngine):
    """A one-rank loop with short steered-session limits that counts its block-boundary exchanges."""
    failures: list[BaseException] = []
    settings = ServingSettings(max_sessions=2, session_idle_timeout_s=2.0, collective_timeout_s=600)
    group = OneRank(engine, settings, on_failure=failures.append)
    exchanges = [0]
    real = group.control.exchange

    def exchange(events, rings):
        exchanges[0] += 1
        return real(events, rings)

    group.control.exchange = exchange
    yield group, exchanges
    group.stop()
    assert not failures, failures


def test_waiting_steered_session_sleeps_until_its_step_or_its_idle_limit(counted) -> None:
    group, exchanges = counted
    first, second = RecordingResponder(), RecordingResponder()
    group.submit(steered_request(), first)
    wait([first])
    group.submit(StepRequest("7", Controls(keys="d")), second)
    wait([second])
    assert first.blocks == [0] and second.blocks == [1]
    waiting_since, late = exchanges[0], RecordingResponder()
    # No step for session_idle_timeout_s: the loop wakes at that deadline, not before, and ends the session.
    wait_until(lambda: not group.sessions, 30, "the idle session to expire")
    assert exchanges[0] - waiting_since <= 4, "the idle loop went round without news"
    group.submit(StepRequest("7", Controls(keys="d")), late)
    wait([late])
    assert "session_idle_timeout_s=2 s" in late.error


def test_cancellation_wakes_an_idle_loop(counted, monkeypatch) -> None:
    group, exchanges = counted  # the heartbeat is 300 s away: only the doorbell wakes the loop
    release = threading.Event()
    real_decode = group.engine.decode

    def slow_decode(session, output):  # the client gets no block until released: its session lags
        assert release.wait(60)
        return real_decode(session, output)

    monkeypatch.setattr(group.engine, "decode", slow_decode)
    client = RecordingResponder()
    group.submit(tiny_request(decode=False, num_frames=129), client)
    lagging = lambda: [s for s in list(group.scheduler.table.values()) if s.computed >= 2]  # noqa: E731
    wait_until(lagging, 60, "the session to run max_blocks_ahead blocks ahead of its client")
    idle_since = exchanges[0]
    client.cancelled = True
    wait_until(lambda: not group.sessions, 5, "the cancelled session to end")
    release.set()
    assert exchanges[0] - idle_since <= 3, "the idle loop went round without news"


class OrderedResponder(RecordingResponder):
    """Records into a list shared by several responders, to check the order they were answered in."""

    def __init__(self, name: str, answers: list[str]) -> None:
        super().__init__()
        self.name, self.answers = name, answers

    def send_block(self, output: BlockOutput, frames: np.ndarray, decode_ms: float, final: bool) -> None:
        self.answers.append(f"{self.name}: block {output.block_index}")
        super().send_block(output, frames, decode_ms, final)

    def finish(self) -> None:
        self.answers.append(f"{self.name}: closed")
        super().finish()


def pause() -> StepRequest:
    return StepRequest("7", None, pause=True)


@pytest.fixture()
def ended(engine: WorldModelEngine):
    """A one-rank loop (steered idle limit 2 s) that records why the sessions it owned ended."""
    failures: list[BaseException] = []
    reasons: list[str] = []
    settings = ServingSettings(max_sessions=2, session_idle_timeout_s=2.0)
    group = OneRank(engine, settings, on_failure=failures.append, on_ended=reasons.append)
    yield group, reasons
    group.stop()
    assert not failures, failures


def test_a_pause_stops_the_idle_clock_and_is_answered_before_the_next_request(ended) -> None:
    group, reasons = ended
    answers: list[str] = []
    first = OrderedResponder("start", answers)
    group.submit(steered_request(), first)
    wait([first])
    one, two = OrderedResponder("pause 1", answers), OrderedResponder("pause 2", answers)
    group.submit(pause(), one)
    # Three idle limits without a step: the open pause keeps the session (an expiry would close the pause).
    assert not one.closed.wait(3 * group.settings.session_idle_timeout_s), one.error
    group.submit(pause(), two)  # a second pause answers the first
    step = OrderedResponder("step", answers)
    group.submit(StepRequest("7", Controls(keys="d")), step)
    wait([step])
    assert answers == ["start: block 0", "pause 1: closed", "pause 2: closed", "step: block 1"]
    assert one.error is None and two.error is None and not one.blocks and not two.blocks
    (shared,) = group.scheduler.table.values()
    assert shared.requests == 2 and shared.computed == 2  # the pauses asked for no block
    # Every request answered, no pause: the idle clock runs again and ends the session.
    wait_until(lambda: reasons, 10, "the session to expire")
    assert reasons == ["expired"]


def test_a_cancelled_pause_ends_its_session_as_cancelled(ended) -> None:
    group, reasons = ended
    first, paused = RecordingResponder(), RecordingResponder()
    group.submit(steered_request(), first)
    wait([first])
    group.submit(pause(), paused)
    paused.cancelled = True  # the client's stream closed
    wait_until(lambda: reasons, 5, "the session to end")
    assert reasons == ["cancelled"] and not group.sessions


def test_pauses_without_a_running_session_get_errors_naming_the_pause(ended) -> None:
    group, reasons = ended
    stranger = RecordingResponder()
    group.submit(pause(), stranger)
    wait([stranger])
    assert re.fullmatch(r"request parameter 'pause': no running session 7: it never started here.*", stranger.error)
    first, closing, late = RecordingResponder(), RecordingResponder(), RecordingResponder()
    group.submit(steered_request(), first)
    wait([first])
    group.submit(StepRequest("7", None, end=True), closing)
    group.submit(pause(), late)
    wait([late])
    assert late.error == ("request parameter 'pause': no running session 7: it was ended by its end flag; start a "
                          "new one")
    wait([closing])
    assert first.blocks == [0] and closing.error is None and reasons == ["ended by its client"]


def test_an_open_pause_still_ends_at_max_session_s(engine: WorldModelEngine) -> None:
    reasons: list[str] = []
    failures: list[BaseException] = []
    settings = ServingSettings(max_sessions=2, session_idle_timeout_s=60.0, max_session_s=2.0)
    group = OneRank(engine, settings, on_failure=failures.append, on_ended=reasons.append)
    try:
        first, paused = RecordingResponder(), RecordingResponder()
        group.submit(steered_request(), first)
        wait([first])
        group.submit(pause(), paused)
        wait([paused], timeout=10)
    finally:
        group.stop()
    assert not failures and reasons == ["expired"] and "max_session_s=2 s" in paused.error
