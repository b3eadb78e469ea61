"""Refused or abandoned sequence starts must not take the sequence batcher's slots from valid sessions."""
from __future__ import annotations

import dataclasses
import queue
import statistics
import time

import pytest
import tritonclient.grpc as grpcclient

from backend.api import contract
from backend.api.codec import request_arrays, request_parameters
from backend.api.refusal import Refusal
from backend.api.request import SessionRequest
from client.steer import SteeredSession
from client.stream import new_sequence_id, pack_inputs
from factories import tiny_request
from polling import wait_until
from triton_harness import SP1_QUEUE, SP1_SESSIONS, metrics, stream_in_background

pytestmark = pytest.mark.server  # on the shared real tritonserver

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


def flood_answer(error) -> Refusal:
    assert error is not None, "a start beyond the line was served"
    refusal = Refusal.parse(error.message())
    assert refusal is not None, f"an error without a code: {error.message()}"
    return refusal


@pytest.mark.slow  # one refused start's code is also tested in test_triton_server
def test_a_flood_of_starts_gets_codes_at_once_and_locks_nobody_out(sp1_server) -> None:
    """On the shared SP1 server: while SP1_SESSIONS sessions play (every slot), REFUSED_STARTS starts arrive at once
    on one stream: half are bad input (INVALID_INPUT), half valid whole clips, of which max_queue (SP1_QUEUE) wait
    their turn (told their place) and the rest are refused CAPACITY_EXHAUSTED with a retry time. Every answer comes
    with its code, the players play to their end, the waiting ones are served, the refusals are counted by code,
    and a valid session afterwards starts about as fast as on the idle server."""
    server = sp1_server
    wait_until(lambda: metrics(server).get("lingbot_world_free_slots") == SP1_SESSIONS, 60, "every slot free")
    refused_before = metrics(server).get("lingbot_world_refusals_total", 0)
    idle = statistics.median(first_block_s(server.grpc_url) for _ in range(3))
    players, failed = stream_in_background(server.grpc_url, range(SP1_SESSIONS), timeout=240)
    wait_until(lambda: metrics(server).get("lingbot_world_free_slots") == 0, 60, "the sessions to play")
    bad = dataclasses.replace(steered_start(), keys="zq")  # the model refuses it (Triton passes it on)
    good = tiny_request(num_frames=9, decode=False)
    answers: queue.Queue = queue.Queue()
    sent = time.perf_counter()
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        for i in range(REFUSED_STARTS):
            request, end = (bad, False) if i % 2 else (good, True)
            client.async_stream_infer(contract.MODEL_NAME, pack_inputs(request_arrays(request)),
                                      parameters=request_parameters(request), sequence_id=new_sequence_id(),
                                      sequence_start=True, sequence_end=end, enable_empty_final_response=True)
        codes: dict[str, int] = {}
        places = served = 0
        while sum(codes.values()) + served < REFUSED_STARTS:
            try:
                result, error = answers.get(timeout=max(0.1, sent + 60 - time.perf_counter()))
            except queue.Empty:
                pytest.fail(f"{REFUSED_STARTS - sum(codes.values()) - served} starts unanswered after 60 s")
            if error is None:
                if result.as_numpy(contract.QUEUE_POSITION) is not None:
                    places += 1
                elif result.as_numpy(contract.BLOCK_INDEX) is not None:
                    served += 1  # a waiting clip's one block (its final response)
                continue
            refusal = flood_answer(error)
            codes[refusal.code] = codes.get(refusal.code, 0) + 1
            if refusal.code == contract.CAPACITY_EXHAUSTED:
                assert refusal.retry_after_s >= 1 and f"max_queue={SP1_QUEUE}" in refusal.sentence
        client.stop_stream()
    answered_s = time.perf_counter() - sent
    for player in players:
        player.join(240)
    assert not failed, failed
    assert codes == {contract.INVALID_INPUT: REFUSED_STARTS // 2,
                     contract.CAPACITY_EXHAUSTED: REFUSED_STARTS // 2 - SP1_QUEUE}, codes
    assert served == SP1_QUEUE and places >= SP1_QUEUE  # those that waited were told their place (and 0) and served
    counted = metrics(server)
    assert counted["lingbot_world_refusals_total"] - refused_before == REFUSED_STARTS - SP1_QUEUE
    after = first_block_s(server.grpc_url)
    print(f"idle first block {idle:.3f} s; {REFUSED_STARTS} starts answered in {answered_s:.1f} s; first block "
          f"after {after:.3f} s")
    assert after < 2 * max(idle, 1.0)
    wait_until(lambda: metrics(server).get("lingbot_world_free_slots") == SP1_SESSIONS, 30, "every slot free again")
