"""A steered session lives as long as its client: pauses keep a quiet client's session and show a vanished one."""
from __future__ import annotations

import dataclasses
import os
import queue
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient

import client.steer
from backend.api import contract
from backend.api.codec import controls_arrays, request_arrays, request_parameters
from backend.api.request import Controls, SessionRequest
from client.steer import PAUSE_ID, SteeredSession
from client.stream import new_sequence_id, pack_inputs
from factories import forward_poses, tiny_request
from polling import wait_until
from triton_harness import SP2_IDLE_S, metrics

pytestmark = pytest.mark.server  # starts real tritonservers

ROOT = Path(__file__).resolve().parents[1]

# A player that plays three blocks, then sends nothing (SteeredSession keeps a pause open) until it is killed.
PLAYER = """
import dataclasses, sys, threading
from backend.api.request import Controls
from client.steer import SteeredSession
from factories import tiny_request
session = SteeredSession(sys.argv[1])
session.start(dataclasses.replace(tiny_request(num_frames=9, decode=False), num_frames=None, poses=None, keys="w"))
session.next_block(60)
for _ in range(2):
    session.step(Controls(keys="w"))
    session.next_block(60)
print("played", flush=True)
threading.Event().wait()
"""


# A player whose start waits in the queue for a slot: once told its place, it sends a pause (as a client that keeps
# one open does), then nothing until it is killed.
QUEUED = """
import dataclasses, sys, threading
import tritonclient.grpc as grpcclient
from backend.api import contract
from backend.api.codec import parse_place, request_arrays, request_parameters
from client.steer import PAUSE_ID
from client.stream import new_sequence_id, pack_inputs
from factories import tiny_request
request = dataclasses.replace(tiny_request(num_frames=9, decode=False), num_frames=None, poses=None, keys="w")
placed = threading.Event()
def answered(result, error):
    if error is None and parse_place(result.as_numpy) is not None:
        placed.set()
client = grpcclient.InferenceServerClient(sys.argv[1])
client.start_stream(callback=answered)
sequence = new_sequence_id()
client.async_stream_infer(contract.MODEL_NAME, pack_inputs(request_arrays(request)), sequence_id=sequence,
                          sequence_start=True, parameters=request_parameters(request), enable_empty_final_response=True)
assert placed.wait(120), "no place in the queue"
client.async_stream_infer(contract.MODEL_NAME, pack_inputs({}), request_id=PAUSE_ID, sequence_id=sequence,
                          parameters={contract.PARAM_PAUSE: True}, enable_empty_final_response=True)
print("queued", flush=True)
threading.Event().wait()
"""


def steered(**changes) -> SessionRequest:
    base = tiny_request(num_frames=9, decode=False)
    return dataclasses.replace(base, num_frames=None, poses=None, keys="w", **changes)


def ended(server, reason: str) -> float:
    """lingbot_world_sessions_ended_total{reason} summed over ranks."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    pattern = rf'^lingbot_world_sessions_ended_total{{[^}}]*reason="{reason}"[^}}]*}} (\S+)$'
    return sum(float(v) for v in re.findall(pattern, text, re.MULTILINE))


def log_count(server, what: str) -> int:
    return len(re.findall(rf"session r\d-\d+ {what}", Path(server.log_path).read_text()))


def happens_within(condition, seconds: float) -> bool:
    try:
        wait_until(condition, seconds, "")
    except AssertionError:
        return False
    return True


def test_a_killed_player_ends_its_session_as_cancelled_within_5_s(sp2_server, tmp_path: Path) -> None:
    server = sp2_server
    cancelled, counted = log_count(server, "cancelled after 3 blocks"), ended(server, "cancelled")
    out = tmp_path / "player.out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    with out.open("w") as stdout:
        player = subprocess.Popen([sys.executable, "-c", PLAYER, server.grpc_url], stdout=stdout,
                                  stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        wait_until(lambda: "played" in out.read_text(), 120, f"the player's three blocks ({out})")
        wait_until(lambda: metrics(server).get("lingbot_world_streams_open", 0) >= 1, 10, "the player's pause")
    finally:
        player.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        player.wait(10)
    wait_until(lambda: log_count(server, "cancelled after 3 blocks") > cancelled, 5, "the session logged cancelled")
    took = time.monotonic() - killed
    print(f"SIGKILL to 'cancelled' in the log: {took:.2f} s")
    wait_until(lambda: ended(server, "cancelled") >= counted + 1, 5, "the cancelled session counted")
    with SteeredSession(server.grpc_url) as session:  # the server serves a new session
        session.start(steered(seed=3))
        assert session.next_block(60).block_index == 0
        session.step(Controls(keys="d"), end=True)
        assert session.next_block(60).block_index == 1


def test_a_player_killed_while_it_waits_in_the_queue_is_cancelled_there_within_5_s(sp2_server, tmp_path: Path) -> None:
    """Every slot held (max_sessions=3), a fourth player is told its place in the queue, sends its pause and is
    SIGKILLed: its session ends cancelled while the slots are still held, within 5 s, and leaves the queue: it is
    never seated to run blocks for nobody."""
    server = sp2_server
    holders = [SteeredSession(server.grpc_url) for _ in range(3)]
    out = tmp_path / "queued.out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    try:
        for seed, holder in enumerate(holders, 20):
            holder.start(steered(seed=seed))
            assert holder.next_block(60).block_index == 0
        counted = ended(server, "cancelled")
        with out.open("w") as stdout:
            player = subprocess.Popen([sys.executable, "-c", QUEUED, server.grpc_url], stdout=stdout,
                                      stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        try:
            wait_until(lambda: "queued" in out.read_text(), 120, f"the player's place and pause ({out})")
            wait_until(lambda: metrics(server).get("lingbot_world_queue_depth", 0) >= 1, 10, "the player queued")
        finally:
            player.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            player.wait(10)
        wait_until(lambda: ended(server, "cancelled") >= counted + 1, 5, "the queued session ended cancelled")
        print(f"SIGKILL of a queued player to its session ended cancelled: {time.monotonic() - killed:.2f} s")
        assert metrics(server).get("lingbot_world_queue_depth", 0) == 0
        assert metrics(server).get("lingbot_world_free_slots") == 0  # the holders' still
    finally:
        for holder in holders:
            holder.close()
    with SteeredSession(server.grpc_url) as session:  # a slot is free again for a new session
        session.start(steered(seed=8))
        assert session.next_block(60).block_index == 0


@pytest.mark.slow  # three idle limits' wait; the pause's renewal is also tested in test_one_rank
def test_a_quiet_player_keeps_its_session_past_the_idle_limit(sp2_server, monkeypatch) -> None:
    server = sp2_server
    monkeypatch.setattr(client.steer, "RENEW_S", 2.0)  # its pause is renewed several times meanwhile
    with SteeredSession(server.grpc_url) as session:
        session.start(steered(seed=4))
        assert session.next_block(60).block_index == 0
        before = ended(server, "expired")
        # Three idle limits with nothing sent but the library's pauses: no session expires, and its next step
        # gets its block (an ended session would answer it with an error).
        assert not happens_within(lambda: ended(server, "expired") > before, 3 * SP2_IDLE_S)
        session.step(Controls(keys="d"))
        block = session.next_block(60)
        assert block.block_index == 1 and not block.held
        session.end()
        assert session.next_block(60) is None  # the end's own empty answer; the pauses' never surface


class RawSequence:
    """One Triton sequence on a raw gRPC stream: every answer, pauses' included, in arrival order."""

    def __init__(self, url: str) -> None:
        self.id = new_sequence_id()
        self.answers: queue.Queue = queue.Queue()
        self.client = grpcclient.InferenceServerClient(url)
        self.client.start_stream(callback=lambda result, error: self.answers.put((result, error)))

    def send(self, arrays: dict, start: bool = False, end: bool = False, parameters: dict | None = None,
             request_id: str = "") -> None:
        self.client.async_stream_infer(contract.MODEL_NAME, pack_inputs(arrays), request_id=request_id,
                                       parameters=parameters, sequence_id=self.id, sequence_start=start,
                                       sequence_end=end, enable_empty_final_response=True)

    def pause(self, arrays: dict | None = None, **flags) -> None:
        self.send(arrays or {}, parameters={contract.PARAM_PAUSE: True}, request_id=PAUSE_ID, **flags)

    def answer(self, timeout: float = 60) -> tuple:
        return self.answers.get(timeout=timeout)

    def answer_past_places(self, timeout: float = 60) -> tuple:
        """The next answer that is not a place in the queue (a shared server's earlier sessions may hold its slots
        a moment)."""
        deadline = time.monotonic() + timeout
        while True:
            result, error = self.answer(max(0.0, deadline - time.monotonic()))
            if error is not None or result.as_numpy(contract.QUEUE_POSITION) is None:
                return result, error

    def error(self, timeout: float = 60) -> str:
        result, error = self.answer(timeout)
        assert error is not None, result.get_response()
        return error.message()

    def close(self) -> None:
        self.client.stop_stream(cancel_requests=True)
        self.client.close()


def is_pause_answer(answer: tuple) -> bool:
    result, error = answer
    response = None if result is None else result.get_response()
    return error is None and response.id == PAUSE_ID and not response.outputs


def test_bad_pauses_get_clear_errors_and_a_flood_leaves_one_open(sp2_server) -> None:
    url = sp2_server.grpc_url
    stranger = RawSequence(url)
    finished = RawSequence(url)
    player = RawSequence(url)
    try:
        stranger.pause()  # a sequence that never started: Triton's sequence batcher refuses it
        assert "must specify the START flag" in stranger.error()
        request = steered(seed=5, max_blocks=1)
        finished.send(request_arrays(request), start=True, parameters=request_parameters(request))
        assert finished.answer_past_places()[1] is None  # its one block
        finished.pause()  # its one block was its last: the session has finished
        assert re.fullmatch(r"\[SESSION_UNKNOWN\] request parameter 'pause': no running session \d+: it finished",
                            finished.error())

        request = steered(seed=6)
        player.send(request_arrays(request), start=True, parameters=request_parameters(request))
        assert player.answer()[1] is None
        player.pause({contract.CAMERA_POSES: forward_poses(12)})
        assert "a pause (request parameter 'pause') carries no block: send it without ['camera_poses']" \
               in player.error()
        player.pause(request_arrays(request), start=True)
        # Triton's sequence batcher passes a second start on; the model refuses it as a pause with a start flag
        assert "a request with the start flag cannot pause" in player.error()
        floods = 200
        for _ in range(floods):
            player.pause()
        # Each pause answers the one before it: all but the last are answered, empty, and only one stays open.
        answers = [player.answer(30) for _ in range(floods - 1)]
        assert all(is_pause_answer(a) for a in answers)
        with pytest.raises(queue.Empty):
            player.answers.get_nowait()
        wait_until(lambda: metrics(sp2_server).get("lingbot_world_streams_open", 0) == 1, 10, "one open pause")
        player.send(controls_arrays(Controls(keys="d")), parameters={contract.PARAM_RETURN_LATENTS: False})
        assert is_pause_answer(player.answer())  # the last pause, answered before the step's block
        result, error = player.answer()
        assert error is None and int(result.as_numpy(contract.BLOCK_INDEX)[0]) == 1
        player.send({}, end=True)
        assert player.answer()[1] is None
    finally:
        for sequence in (stranger, finished, player):
            sequence.close()
    with SteeredSession(url) as session:  # the server still serves
        session.start(steered(seed=7))
        assert session.next_block(60).block_index == 0


def test_pause_answers_never_reach_the_caller_of_next_block(sp2_server) -> None:
    """The client's own keep-alive: its pause requests are tagged and their answers skipped."""
    with SteeredSession(sp2_server.grpc_url) as session:
        session.start(steered(seed=8))
        blocks = [session.next_block(60)]
        for keys in ("w", "a", "d"):
            session.step(Controls(keys=keys))
            blocks.append(session.next_block(60))
        session.end()
        assert session.next_block(60) is None
    assert [b.block_index for b in blocks] == [0, 1, 2, 3] and len(session.sent_s) == 5
