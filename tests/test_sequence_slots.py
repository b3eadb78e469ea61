"""Refused or abandoned sequence starts must not take the sequence batcher's slots from valid sessions."""
from __future__ import annotations

import dataclasses
import queue
import statistics
import time
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient

from backend.api import contract
from backend.api.codec import request_arrays, request_parameters
from backend.api.request import SessionRequest
from client.steer import SteeredSession
from client.stream import new_sequence_id, pack_inputs
from factories import tiny_request
from triton_harness import running_server

pytestmark = pytest.mark.server  # starts a real tritonserver

REFUSED_STARTS = 1000  # the count: one stream, one gRPC client, a few seconds on the tiny checkpoint


def steered_start() -> SessionRequest:
    base = tiny_request(num_frames=9, seed=1, decode=False)
    return dataclasses.replace(base, num_frames=None, poses=None, keys="w")


def first_block_s(url: str) -> float:
    """A valid steered session: its start to its first block (then its end)."""
    with SteeredSession(url) as session:
        began = time.perf_counter()
        session.start(steered_start())
        assert session.next_block(60).block_index == 0
        took = time.perf_counter() - began
        session.end()
        assert session.next_block(60) is None
    return took


def test_refused_starts_leave_no_slot_behind(tmp_path: Path, tiny_checkpoint: str) -> None:
    """After REFUSED_STARTS steered starts refused for bad input (none ever sends END), every refusal came at
    once and a valid session's first block comes within 2x of the idle server's (1 s floor: a 2-core host's
    noise on a sub-second figure)."""
    with running_server(tmp_path, tiny_checkpoint, sp=1, max_sessions="1", max_queue="1") as server:
        idle = statistics.median(first_block_s(server.grpc_url) for _ in range(3))
        request = dataclasses.replace(steered_start(), keys="zq")  # the model refuses it (Triton passes it on)
        arrays = request_arrays(request)
        answers: queue.Queue = queue.Queue()
        with grpcclient.InferenceServerClient(server.grpc_url) as client:
            client.start_stream(callback=lambda result, error: answers.put(error))
            slowest = 0.0
            for i in range(REFUSED_STARTS):
                sent = time.perf_counter()
                client.async_stream_infer(contract.MODEL_NAME, pack_inputs(arrays),
                                          parameters=request_parameters(request), sequence_id=new_sequence_id(),
                                          sequence_start=True, enable_empty_final_response=True)
                try:
                    error = answers.get(timeout=10)
                except queue.Empty:
                    pytest.fail(f"refused start {i} not answered within 10 s (a sequence slot is held)")
                slowest = max(slowest, time.perf_counter() - sent)
                assert error is not None and "unknown key" in error.message(), (i, error)
            client.stop_stream()
        after = first_block_s(server.grpc_url)
        print(f"idle first block {idle:.3f} s; slowest refusal {slowest * 1000:.1f} ms; first block after "
              f"{REFUSED_STARTS} refused starts {after:.3f} s")
        assert slowest < 2.0
        assert after < 2 * max(idle, 1.0)
