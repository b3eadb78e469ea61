"""The group loop with one rank and recording responders: streams, per-session failures, cancellation."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from backend.config import ServingConfig
from backend.coordinator import GroupCoordinator
from backend.engine import BlockOutput, WorldModelEngine
from factories import tiny_config, tiny_request


class RecordingResponder:
    def __init__(self) -> None:
        self.blocks: list[int] = []
        self.error: str | None = None
        self.closed = threading.Event()
        self.cancelled = False

    def send_block(self, output: BlockOutput, frames: np.ndarray, decode_ms: float, final: bool) -> None:
        self.blocks.append(output.block_index)
        if final:
            self.closed.set()

    def send_error(self, message: str) -> None:
        self.error = message
        self.closed.set()

    def finish(self) -> None:
        self.closed.set()

    def is_cancelled(self) -> bool:
        return self.cancelled or (self.closed.is_set() and self.error is not None)


@pytest.fixture()
def coordinator(tiny_checkpoint: str):
    failures: list[BaseException] = []
    engine = WorldModelEngine(tiny_config(tiny_checkpoint, decode_frames=False))
    group = GroupCoordinator(engine, ServingConfig(max_sessions=2), None, on_failure=failures.append)
    yield group
    group.stop()
    assert not failures, failures


def wait(responders: list[RecordingResponder], timeout: float = 60) -> None:
    for r in responders:
        assert r.closed.wait(timeout), "a stream never ended"


def test_streams_complete_in_order(coordinator: GroupCoordinator) -> None:
    responders = [RecordingResponder() for _ in range(3)]
    for seed, r in enumerate(responders):
        coordinator.submit(tiny_request(num_frames=21, seed=seed), r)
    wait(responders)
    assert all(r.blocks == [0, 1] and r.error is None for r in responders)
    assert not coordinator.sessions


def test_failed_open_errors_that_stream_only(coordinator: GroupCoordinator, monkeypatch) -> None:
    real_open = coordinator.engine.open_session

    def open_session(request, session_id=None):
        if request.seed == 13:
            raise RuntimeError("CUDA out of memory (simulated)")
        return real_open(request, session_id)

    monkeypatch.setattr(coordinator.engine, "open_session", open_session)
    bad, good = RecordingResponder(), RecordingResponder()
    coordinator.submit(tiny_request(num_frames=9, seed=13), bad)
    coordinator.submit(tiny_request(num_frames=9, seed=1), good)
    wait([bad, good])
    assert "opening the session failed" in bad.error and "out of memory" in bad.error
    assert good.blocks == [0] and good.error is None


def test_failed_decode_ends_the_stream_and_frees_its_slot(coordinator: GroupCoordinator, monkeypatch) -> None:
    real_decode = coordinator.engine.decode

    def decode(session, output):
        if session.request.seed == 13 and output.block_index == 1:
            raise RuntimeError("decoder broke (simulated)")
        return real_decode(session, output)

    monkeypatch.setattr(coordinator.engine, "decode", decode)
    broken = RecordingResponder()
    coordinator.submit(tiny_request(num_frames=129, seed=13), broken)
    wait([broken])
    assert broken.blocks == [0] and "decoder broke" in broken.error
    deadline = time.monotonic() + 30
    while coordinator.sessions and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not coordinator.sessions, "the broken session kept its slot"
    others = [RecordingResponder() for _ in range(2)]  # both slots are free again
    for seed, r in enumerate(others):
        coordinator.submit(tiny_request(num_frames=9, seed=seed), r)
    wait(others)
    assert all(r.blocks == [0] for r in others)


def test_cancelled_stream_is_dropped(coordinator: GroupCoordinator) -> None:
    responder = RecordingResponder()
    coordinator.submit(tiny_request(num_frames=129), responder)
    while not responder.blocks:
        time.sleep(0.01)
    responder.cancelled = True
    wait([responder])
    assert len(responder.blocks) < 11 and responder.error is None
    assert not coordinator.sessions
