"""The front door of a real tritonserver opened to the internet: gRPC over TLS with certificates `openssl` makes
here, and a key per user. As an attacker would: a plaintext client, a client that trusts another CA, one without a
certificate where mutual TLS is on, no key, a wrong key, a key in a prompt, 1,000 wrong keys in a row while another
user is served, a key revoked by a reload; and the key never shows in the log, the metrics or a recording."""
from __future__ import annotations

import dataclasses
import json
import os
import queue
import signal
import ssl
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from backend.api import contract as c
from backend.launch.agent import CapacityAgent, GroupProbe
from backend.launch.launcher import reload_keys
from backend.fleet.balancer import (BalancerTls, GroupAddress, check_config, render_haproxy, server_states,
                                     start_haproxy)
from backend.launch.procfs import status_kib
from backend.launch.server import TritonServer, Tls
from backend.parallel.ports import free_port
from backend.launch.wheel import prepare_backends
from backend.api.request import Controls
from backend.serving.keys import Quota, key_line, new_sequence
from client.connection import Connection
from client.recording import Recorder
from client.steer import SteeredSession
from client.stream import StreamError, StreamingSession, pack_inputs, request_inputs
from factories import TINY_SIZE, tiny_request
from bridge_harness import running_bridge
from test_web_player import CHROMIUM, CHROMIUM_ARGS
from polling import wait_until
from tls_harness import Pki, make_pki
from triton_harness import metrics, running_server

pytestmark = pytest.mark.server  # starts real tritonservers

KEYS = {name: new_sequence() for name in ("alice", "bob", "carol", "erin")}
# alice: one session and no place in the queue; erin: two blocks an hour; bob and carol: two sessions each.
QUOTAS = {"alice": Quota(sessions=1, queue=0), "bob": Quota(sessions=2), "carol": Quota(sessions=2),
          "erin": Quota(blocks_per_hour=2)}


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def door(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: str, pki: Pki):
    """One SP1 server with TLS and a keys file (alice, bob, carol), as the launcher runs it."""
    tmp = tmp_path_factory.mktemp("door")
    keys_file = tmp / "keys.txt"
    keys_file.write_text("".join(key_line(n, k, QUOTAS[n]) + "\n" for n, k in KEYS.items()))
    with running_server(tmp, tiny_checkpoint, tls=Tls(pki.server_cert, pki.server_key), keys_file=keys_file,
                        max_sessions="2") as server:
        yield server


def trusted(pki: Pki, key: str | None = None) -> Connection:
    return Connection(ca=pki.ca, key=key)


def clip(server: TritonServer, connection: Connection, **parameters) -> list:
    """A one-block whole trajectory; StreamError with the server's refusal."""
    with StreamingSession(server.grpc_url, connection=connection) as session:
        session.send(request_inputs(tiny_request(num_frames=9)), parameters={"return_latents": False, **parameters})
        return list(session.responses(120))


def refusal_code(call) -> str | None:
    with pytest.raises(StreamError) as raised:
        call()
    return raised.value.code


def test_a_client_with_the_ca_and_a_key_is_served(door, pki: Pki) -> None:
    blocks = clip(door, trusted(pki, KEYS["alice"]))
    assert len(blocks) == 1 and blocks[0].frames.shape[0] > 0
    wait_until(lambda: metrics(door).get("lingbot_world_key_blocks_total", 0) >= 1, 10, "the block counted by key")


@pytest.mark.parametrize("connection", ["plaintext", "stranger CA"])
def test_a_plaintext_client_or_one_trusting_another_ca_is_refused(door, pki: Pki, connection: str) -> None:
    client = Connection(key=KEYS["alice"]) if connection == "plaintext" else Connection(ca=pki.stranger_ca)
    with client.client(door.grpc_url) as probe, pytest.raises(InferenceServerException, match="UNAVAILABLE"):
        probe.is_server_live(client_timeout=10)
    assert refusal_code(lambda: clip(door, client)) is None  # the stream never reached the model


def test_no_key_a_wrong_key_and_a_key_in_a_prompt_are_refused_by_code(door, pki: Pki) -> None:
    assert refusal_code(lambda: clip(door, trusted(pki))) == c.AUTH_REQUIRED
    assert refusal_code(lambda: clip(door, trusted(pki, new_sequence()))) == c.AUTH_INVALID
    assert refusal_code(lambda: clip(door, trusted(pki, KEYS["alice"][:-1]))) == c.AUTH_INVALID
    with StreamingSession(door.grpc_url, connection=trusted(pki)) as session:
        request = tiny_request(num_frames=9, prompt=KEYS["alice"])
        session.send(request_inputs(request), parameters={"expect_settings": KEYS["bob"]})
        with pytest.raises(StreamError) as raised:
            list(session.responses(60))
    assert raised.value.code == c.AUTH_REQUIRED


def test_a_thousand_wrong_keys_cost_no_model_work_while_another_user_is_served(door, pki: Pki) -> None:
    """The wrong keys ride as request parameters on one stream (what Triton makes of the header); bob's session
    runs meanwhile. The group never hears of them: the blocks run are bob's alone."""
    before = settled(door)
    answers: queue.Queue = queue.Queue()
    inputs = request_inputs(tiny_request(num_frames=9))
    with trusted(pki).client(door.grpc_url) as attacker, \
            StreamingSession(door.grpc_url, connection=trusted(pki, KEYS["bob"])) as bob:
        bob.send(request_inputs(tiny_request(num_frames=21)), parameters={"return_latents": False})
        attacker.start_stream(callback=lambda result, error: answers.put(error))
        began = time.monotonic()
        for n in range(1000):
            attacker.async_stream_infer(c.MODEL_NAME, inputs, sequence_id=n + 1, sequence_start=True,
                                        sequence_end=True, parameters={c.KEY_HEADER: new_sequence()})
        errors = [answers.get(timeout=60) for _ in range(1000)]
        took = time.monotonic() - began
        attacker.stop_stream()
        served = list(bob.responses(120))
    assert all(e is not None and e.message().startswith(f"[{c.AUTH_INVALID}]") for e in errors)
    assert len(served) == 2
    after = settled(door)
    assert after["lingbot_world_blocks_run_total"] - before["lingbot_world_blocks_run_total"] == 2  # bob's
    assert after["lingbot_world_refusals_total"] - before.get("lingbot_world_refusals_total", 0) == 1000
    print(f"1,000 wrong keys refused in {took:.2f} s ({took:.3f} ms each) while bob's 2 blocks ran")


def settled(server: TritonServer) -> dict[str, float]:
    """The metrics once two reads half a second apart agree (a response is counted just after it is sent)."""
    reads = [metrics(server)]

    def same() -> dict[str, float] | None:
        reads.append(metrics(server))
        return reads[-1] if reads[-1] == reads[-2] else None

    return wait_until(same, 30, "the metrics to settle", interval=0.5)


def steered_start():
    return dataclasses.replace(tiny_request(num_frames=9), num_frames=None, poses=None, keys="w",
                               return_latents=False)


def test_a_key_past_its_session_cap_is_refused_while_another_key_is_served_at_once(door, pki: Pki) -> None:
    with SteeredSession(door.grpc_url, connection=trusted(pki, KEYS["alice"])) as first, \
            SteeredSession(door.grpc_url, connection=trusted(pki, KEYS["alice"])) as second:
        first.start(steered_start())
        assert first.next_block(120).block_index == 0  # alice holds her one slot
        began = time.monotonic()
        second.start(steered_start())
        assert refusal_code(lambda: second.next_block(60)) == c.USER_SESSION_LIMIT
        assert len(clip(door, trusted(pki, KEYS["bob"]))) == 1  # the server's other slot is bob's at once
        assert time.monotonic() - began < 30
        first.end()
        assert first.next_block(60) is None


def test_a_step_with_another_key_on_a_users_sequence_is_refused_and_touches_nothing(door, pki: Pki) -> None:
    with SteeredSession(door.grpc_url, connection=trusted(pki, KEYS["bob"])) as bobs:
        bobs.start(steered_start())
        assert bobs.next_block(120).block_index == 0
        errors: queue.Queue = queue.Queue()
        attacker = trusted(pki, KEYS["alice"])
        with attacker.client(door.grpc_url) as client:
            client.start_stream(callback=lambda result, error: errors.put(error), headers=attacker.headers())
            for _ in range(3):  # steps on bob's sequence (its id is a secret of bob's client: docs/security.md)
                client.async_stream_infer(c.MODEL_NAME, request_inputs_of({c.ACTION: "w"}),
                                          sequence_id=bobs.sequence_id)
            client.async_stream_infer(c.MODEL_NAME, [], sequence_id=bobs.sequence_id, parameters={c.PARAM_PAUSE: True})
            refused = [errors.get(timeout=60) for _ in range(4)]
            client.stop_stream()
        assert all(e is not None and e.message().startswith(f"[{c.AUTH_INVALID}]") for e in refused)
        bobs.step(Controls(keys="d"))
        assert bobs.next_block(120).block_index == 1  # bob's world went on, one block per step of his own
        bobs.end()
        assert bobs.next_block(60) is None


def request_inputs_of(values: dict[str, str]) -> list:
    return pack_inputs({name: np.array([text.encode()], dtype=np.object_) for name, text in values.items()})


def test_the_queue_is_fair_between_keys_a_later_key_gets_the_next_slot(door, pki: Pki) -> None:
    """carol takes both slots and queues three more; bob queues one after them: he is told he is next, and the
    slot carol frees is his."""
    carol = trusted(pki, KEYS["carol"])
    holders = [SteeredSession(door.grpc_url, connection=carol) for _ in range(2)]
    for holder in holders:
        holder.start(steered_start())
        assert holder.next_block(120).block_index == 0
    places: dict[str, queue.Queue] = {name: queue.Queue() for name in ("carol", "bob")}
    queued = [SteeredSession(door.grpc_url, connection=carol, on_place=places["carol"].put) for _ in range(3)]
    bob = SteeredSession(door.grpc_url, connection=trusted(pki, KEYS["bob"]), on_place=places["bob"].put)
    try:
        for session in queued:
            session.start(steered_start())
        wait_until(lambda: places["carol"].qsize() >= 3, 30, "carol's sessions to be told their places")
        bob.start(steered_start())
        assert places["bob"].get(timeout=30).position == 1  # first in the queue, ahead of carol's three
        holders[0].end()
        assert holders[0].next_block(60) is None
        assert bob.next_block(120).block_index == 0  # the freed slot is bob's
        assert metrics(door)["lingbot_world_queue_depth"] == 3  # carol's three still wait
    finally:
        for session in (*holders, *queued, bob):
            session.close()


def test_a_key_out_of_its_blocks_for_the_hour_is_refused_with_a_retry_time(door, pki: Pki) -> None:
    with StreamingSession(door.grpc_url, connection=trusted(pki, KEYS["erin"])) as session:
        session.send(request_inputs(tiny_request(num_frames=33)), parameters={"return_latents": False})
        blocks = []
        with pytest.raises(StreamError) as raised:
            for block in session.responses(120):
                blocks.append(block)
    assert len(blocks) == 2 and raised.value.code == c.QUOTA_EXHAUSTED
    assert "blocks_per_hour=2" in str(raised.value) and "retry_after_s=" in str(raised.value)


def test_a_reload_revokes_a_key_and_adds_one_without_a_restart(door, pki: Pki, tmp_path: Path) -> None:
    """carol's key is dropped while her steered session runs: the session ends with AUTH_INVALID."""
    carols = SteeredSession(door.grpc_url, connection=trusted(pki, KEYS["carol"]))
    carols.start(steered_start())
    assert carols.next_block(120).block_index == 0
    dave = new_sequence()
    keys_file = Path(door.keys_file)
    kept = {n: k for n, k in KEYS.items() if n != "carol"}
    keys_file.write_text("".join(key_line(n, k, QUOTAS.get(n, Quota())) + "\n"
                                 for n, k in (*kept.items(), ("dave", dave))))
    assert len(door.reload_keys().entries) == len(KEYS)  # what the launcher's SIGHUP does
    wait_until(lambda: refusal_code_of(door, trusted(pki, KEYS["carol"])) == c.AUTH_INVALID, 10,
               "carol's key to be refused")
    assert len(clip(door, trusted(pki, dave))) == 1
    assert len(clip(door, trusted(pki, KEYS["alice"]))) == 1
    with carols:
        carols.step(Controls(keys="w"))
        assert refusal_code(lambda: carols.next_block(60)) == c.AUTH_INVALID


def test_sighup_with_a_broken_keys_file_names_its_line_and_the_keys_in_force_stay(door, pki: Pki, capsys) -> None:
    """The launcher's SIGHUP (its handler, on a real signal): a keys file with a bad line is refused naming it, nothing
    is published, and a key in force is still served; the file mended, the next SIGHUP takes it."""
    keys_file = Path(door.keys_file)
    good = keys_file.read_text()
    previous = signal.signal(signal.SIGHUP, lambda *_: reload_keys(door))  # as launcher.main installs it
    try:
        keys_file.write_text(good + "mallory not-a-hash\n")
        os.kill(os.getpid(), signal.SIGHUP)
        bad_line = len(good.splitlines()) + 1
        err = capsys.readouterr().err
        assert "SIGHUP: the keys file was not reloaded, the keys in force stay" in err and f"line {bad_line}:" in err
        assert len(clip(door, trusted(pki, KEYS["alice"]))) == 1
        keys_file.write_text(good)
        os.kill(os.getpid(), signal.SIGHUP)
        assert f"SIGHUP: keys reloaded from {door.keys_file}" in capsys.readouterr().out
    finally:
        signal.signal(signal.SIGHUP, previous)
        keys_file.write_text(good)


def refusal_code_of(server: TritonServer, connection: Connection) -> str | None:
    try:
        clip(server, connection)
    except StreamError as exc:
        return exc.code
    return None


def test_the_key_never_shows_in_the_log_the_metrics_or_a_recording(door, pki: Pki, tmp_path: Path) -> None:
    steered = dataclasses.replace(tiny_request(num_frames=9), num_frames=None, poses=None, keys="w",
                                  return_used=True)
    recorder = Recorder(steered)
    with SteeredSession(door.grpc_url, connection=trusted(pki, KEYS["bob"])) as session:
        session.start(steered)
        session.end()
        block = session.next_block(120)
        recorder.add(block)
    path = recorder.save(tmp_path / "world.npz")
    text = urllib.request.urlopen(f"http://127.0.0.1:{door.metrics_port}/metrics", timeout=10).read().decode()
    assert 'key="bob"' in text
    stored = [door.log_path.read_bytes(), text.encode(), path.read_bytes()]
    for key in KEYS.values():
        for blob in stored:
            assert key.encode() not in blob


def test_http_inference_is_the_operators_alone_with_tls(door) -> None:
    body = json.dumps({"inputs": []}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{door.http_port}/v2/models/{c.MODEL_NAME}/generate_stream",
                                     data=body, method="POST")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 403 and "restricted" in refused.value.read().decode()


ECHO_CONFIG = """name: "echo"
backend: "python"
max_batch_size: 0
input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""
ECHO_MODEL = """import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("y", pb_utils.get_input_tensor_by_name(r, "x").as_numpy())])
                for r in requests]
"""


def test_mutual_tls_refuses_a_client_without_a_certificate(pki: Pki, tmp_path: Path) -> None:
    """Triton's own TLS as the launcher sets it (a one-line model: what is tested is the port)."""
    (tmp_path / "repo" / "echo" / "1").mkdir(parents=True)
    (tmp_path / "repo" / "echo" / "config.pbtxt").write_text(ECHO_CONFIG)
    (tmp_path / "repo" / "echo" / "1" / "model.py").write_text(ECHO_MODEL)
    tls = Tls(pki.server_cert, pki.server_key, client_ca=pki.ca)
    x = grpcclient.InferInput("x", [1], "FP32").set_data_from_numpy(np.ones(1, np.float32))
    with TritonServer(tmp_path / "repo", backends_dir=prepare_backends(), log_path=tmp_path / "log.txt",
                      tls=tls, extra_args=["--pinned-memory-pool-byte-size=0", "--allow-gpu-metrics=false"]) as server:
        server.wait_ready("echo", timeout=60)
        holder = Connection(ca=pki.ca, client_cert=pki.client_cert, client_key=pki.client_key)
        with holder.client(server.grpc_url) as client:
            assert client.infer("echo", [x]).as_numpy("y").tolist() == [1.0]
        for stranger in (Connection(ca=pki.ca), Connection()):
            with stranger.client(server.grpc_url) as client, pytest.raises(InferenceServerException):
                client.infer("echo", [x], client_timeout=10)


def group_state(stats_socket: Path) -> str | None:
    try:
        return server_states(stats_socket).get("group0")
    except OSError:  # haproxy is starting
        return None


def test_the_balancer_speaks_tls_only_and_refuses_an_oversized_start_before_the_group_reads_it(
        sp1_server, pki: Pki, tmp_path: Path) -> None:
    """HAProxy as the fleet runs it (TLS, HTTP/2 to the group), in front of the shared server: a start whose first
    message is over the cap is refused with 413 from its length prefix; the group's processes do not grow."""
    cap = 4 * 2**20
    agent_port = free_port()
    agent = CapacityAgent(GroupProbe(sp1_server.host, sp1_server.http_port, sp1_server.metrics_port), agent_port,
                          "127.0.0.1").start()
    group = GroupAddress("group0", "127.0.0.1", sp1_server.grpc_port, sp1_server.http_port, agent_port)
    config, port = tmp_path / "haproxy.cfg", free_port()
    config.write_text(render_haproxy([group], "127.0.0.1", port, 0.5, tmp_path / "haproxy.sock",
                                     tls=BalancerTls(pki.server_pem), max_request_bytes=cap))
    check_config(config)
    haproxy = start_haproxy(config, tmp_path / "haproxy.log")
    try:
        wait_until(lambda: group_state(tmp_path / "haproxy.sock") == "UP", 20, "the group UP")
        url = f"localhost:{port}"
        with Connection().client(url) as plain, pytest.raises(InferenceServerException, match="UNAVAILABLE"):
            plain.is_server_live(client_timeout=10)
        with StreamingSession(url, connection=Connection(ca=pki.ca)) as session:
            session.send(request_inputs(tiny_request(num_frames=9)), parameters={"return_latents": False})
            assert len(list(session.responses(120))) == 1
        processes = [sp1_server.pid, *sp1_server.stub_pids().values()]
        before = sum(status_kib(pid, "VmRSS") for pid in processes)
        big = tiny_request(num_frames=9, image=np.zeros((2048, 2048, 3), np.uint8))  # 12 MiB, three times the cap
        with StreamingSession(url, connection=Connection(ca=pki.ca)) as session:
            session.send(request_inputs(big), parameters={"return_latents": False})
            with pytest.raises(StreamError, match="413"):
                list(session.responses(60))
        grown = sum(status_kib(pid, "VmRSS") for pid in processes) - before
        assert grown < 1024, f"the group's processes grew {grown} KiB"
        print(f"an oversized start refused by the balancer: the group's RSS moved {grown} KiB")
    finally:
        haproxy.terminate()
        haproxy.wait(5)
        agent.stop()


@pytest.fixture(scope="module")
def secure_bridge(door, pki: Pki, tmp_path_factory: pytest.TempPathFactory):
    """`python -m client serve` over HTTPS and WSS with sign-in, in front of the TLS server with keys."""
    log = tmp_path_factory.mktemp("secure-bridge") / "bridge.log"
    with running_bridge(door.grpc_url, log, "--ca", str(pki.ca), "--tls-cert", str(pki.server_cert), "--tls-key",
                        str(pki.server_key), "--sign-in", https_ca=pki.ca) as base:
        yield base


def test_the_bridge_speaks_https_only_and_signs_in_with_a_real_key_only(secure_bridge: str, pki: Pki) -> None:
    context = ssl.create_default_context(cafile=str(pki.ca))
    with pytest.raises((urllib.error.URLError, ConnectionError)):  # plaintext HTTP to the HTTPS port
        urllib.request.urlopen(secure_bridge.replace("https", "http") + "/", timeout=10)
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        urllib.request.urlopen(secure_bridge + "/", timeout=10,
                               context=ssl.create_default_context(cafile=str(pki.stranger_ca)))

    def sign_in(key: str) -> tuple[int, str, str]:
        request = urllib.request.Request(secure_bridge + "/signin", data=json.dumps({"key": key}).encode(),
                                         method="POST", headers={"Origin": secure_bridge})
        try:
            with urllib.request.urlopen(request, timeout=30, context=context) as answer:
                return answer.status, answer.headers.get("Set-Cookie", ""), answer.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, "", exc.read().decode()

    status, cookie, text = sign_in(new_sequence())
    assert status == 403 and "not valid" in text and not cookie
    status, cookie, text = sign_in(KEYS["alice"])
    assert status == 200 and KEYS["alice"] not in cookie + text
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Secure" in cookie


@pytest.mark.skipif(not Path(CHROMIUM).is_file(), reason=f"Chromium at {CHROMIUM}")
def test_the_page_signs_in_and_plays_over_wss(secure_bridge: str, pki: Pki, tmp_path: Path) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        page = browser.new_page(ignore_https_errors=True)  # the test CA is not in Chromium's store
        try:
            page.goto(secure_bridge + "/")
            page.wait_for_selector("#signin:not([hidden])", timeout=20_000)
            page.fill("#key", KEYS["bob"])
            page.click("#signin-button")
            page.wait_for_selector("#setup:not([hidden])", timeout=30_000)
            assert page.is_hidden("#signin")  # signed in: the box is gone
            assert page.evaluate("document.cookie") == ""  # HttpOnly: no script reads the token
            page.fill("#prompt", "a castle on a hill")
            page.fill("#width", str(TINY_SIZE))
            page.fill("#height", str(TINY_SIZE))
            page.click("#start")
            wait_until(lambda: int(page.get_attribute("#status", "data-blocks")) >= 2, 120, "two blocks over WSS")
            assert page.evaluate("location.protocol") == "https:"
        finally:
            browser.close()
