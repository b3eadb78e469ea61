"""Nobody gets in: the probes of issue 18 against a real tritonserver with the defaults (loopback only).

Model control is closed to clients, every port listens on loopback, and the group's store trusts only keys
that carry the launch's secret: a value the group did not write fails the group cleanly and a reload serves.
"""
from __future__ import annotations

import base64
import ipaddress
import json
import re
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from backend.api import contract
from backend.launch.procfs import tcp_sockets
from backend.parallel.group import store_client
from backend.parallel.local import free_port
from backend.serving import messages
from client.stream import StreamError
from factories import tiny_request
from polling import wait_until
from triton_harness import inputs_with, metrics, running_server, stream, stream_in_background

pytestmark = pytest.mark.server  # starts real tritonservers

MODEL = contract.MODEL_NAME


def listening_addresses(pids: list[int]) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket these processes listen on."""
    return {(s.address, s.port) for s in tcp_sockets(pids) if s.listening}


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return ip.is_loopback or bool(getattr(ip, "ipv4_mapped", None) and ip.ipv4_mapped.is_loopback)


def http(server, method: str, path: str, body: dict | None = None, headers: dict | None = None) -> tuple[int, str]:
    data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
    request = urllib.request.Request(f"http://127.0.0.1:{server.http_port}{path}", data=data, method=method,
                                     headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_clients_cannot_load_unload_or_index_models(sp1_server, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    payload = f"open({str(marker)!r}, 'w').write('code from a request ran')\n"
    config = json.dumps({"name": "visitor", "backend": "python", "max_batch_size": 0,
                         "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [1]}],
                         "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [1]}]})
    inline = {"config": config, "file:1/model.py": base64.b64encode(payload.encode()).decode()}
    # HTTP: a load carrying the model's files, an unload, the index, shared memory, log and trace settings.
    probes = [("POST", "/v2/repository/models/visitor/load", {"parameters": inline}),
              ("POST", f"/v2/repository/models/{MODEL}/unload", {}),
              ("POST", "/v2/repository/index", {}),
              ("POST", "/v2/systemsharedmemory/region/r/register", {"key": "/x", "offset": 0, "byte_size": 8}),
              ("POST", "/v2/logging", {"log_file": str(tmp_path / "log")}),
              ("POST", "/v2/trace/setting", {"trace_file": str(tmp_path / "trace")})]
    for method, path, body in probes:
        status, text = http(sp1_server, method, path, body)
        assert status == 403 and "restricted" in text, (path, status, text)
    # gRPC: the same refusals.
    with grpcclient.InferenceServerClient(sp1_server.grpc_url) as client:
        calls = [lambda: client.load_model("visitor", config=config, files={"file:1/model.py": payload.encode()}),
                 lambda: client.unload_model(MODEL),
                 lambda: client.get_model_repository_index(),
                 lambda: client.register_system_shared_memory("r", "/x", 8),
                 lambda: client.update_log_settings({"log_file": str(tmp_path / "log")})]
        for call in calls:
            with pytest.raises(InferenceServerException, match="restricted"):
                call()
        assert client.is_model_ready(MODEL)
        assert not client.is_model_ready("visitor")
        # The operator's header opens them (read-only here: the index).
        index = client.get_model_repository_index(headers=sp1_server.admin_headers(), as_json=True)
        assert [m["name"] for m in index["models"]] == [MODEL]
    assert not marker.exists()
    assert http(sp1_server, "POST", "/v2/repository/index", {}, sp1_server.admin_headers(grpc=False))[0] == 200
    assert len(stream(sp1_server.grpc_url, tiny_request(num_frames=9))) == 1


def test_server_ports_listen_on_loopback_only(sp1_server) -> None:
    listening = listening_addresses([sp1_server.pid])
    ports = {port for _, port in listening}
    assert {sp1_server.grpc_port, sp1_server.http_port, sp1_server.metrics_port} <= ports, listening
    assert all(is_loopback(address) for address, _ in listening), listening


@pytest.mark.parametrize("image_shape", [(4097, 4096, 3), (1, 4096 * 4096 + 1, 3)], ids=["tall", "one_row"])
def test_an_oversized_image_is_refused_by_its_shape(sp1_server, image_shape: tuple[int, ...]) -> None:
    image = np.zeros(image_shape, np.uint8)  # 50 MB: within gRPC's limits, over max_input_pixels
    with pytest.raises(StreamError, match=r"image is \d+ x \d+ pixels, more than max_input_pixels=16777216"):
        from client.stream import StreamingSession

        with StreamingSession(sp1_server.grpc_url) as session:
            session.send(inputs_with(image=image))
            list(session.responses(timeout=60))
    assert len(stream(sp1_server.grpc_url, tiny_request(num_frames=9))) == 1


def test_an_action_on_a_whole_trajectory_is_an_error_naming_it(sp1_server) -> None:
    from client.stream import StreamingSession

    for keys in ("w", "nonsense keys"):
        with StreamingSession(sp1_server.grpc_url) as session:
            session.send(inputs_with(action=np.array([keys.encode()], dtype=object)))
            with pytest.raises(StreamError, match="input 'action' steers a session block by block"):
                list(session.responses(timeout=60))


# -- the group's store ------------------------------------------------------------------------------------

TIMEOUT_S = 5


@pytest.fixture(scope="module")
def sp2(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: str):
    port = free_port()
    with running_server(tmp_path_factory.mktemp("sp2"), tiny_checkpoint, sp=2, rendezvous_port=str(port),
                        collective_timeout_s=str(TIMEOUT_S), max_frames="321") as server:
        server.rendezvous_port = port
        yield server


def test_group_ports_listen_on_loopback_only(sp2) -> None:
    stubs = sp2.stub_pids()
    assert len(stubs) == 2
    listening = listening_addresses(list(stubs.values()))
    assert sp2.rendezvous_port in {port for _, port in listening_addresses([stubs[0]])}
    assert len(listening) > 1  # the store and gloo's listeners
    assert all(is_loopback(address) for address, _ in listening), listening


def test_a_stranger_without_the_secret_changes_nothing(sp2) -> None:
    import datetime

    import torch.distributed as dist

    stranger = dist.TCPStore("127.0.0.1", sp2.rendezvous_port, is_master=False, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=10))
    for key in ("lingbot/doorbell", "doorbell", "lingbot/loaded", "lingbot/doorbell/1", "lingbot/doorbell/2"):
        stranger.set(key, b"not a number")
    assert len(stream(sp2.grpc_url, tiny_request(num_frames=21), timeout=60)) == 2
    with grpcclient.InferenceServerClient(sp2.grpc_url) as client:
        assert client.is_model_ready(MODEL)


def assert_plain(errors: list[str]) -> None:
    assert errors and all(e.endswith(messages.GROUP_FAILED.message) or "not ready" in e or "unknown model" in e
                          for e in errors), errors
    assert not any(re.search(r"DistNetworkError|Traceback|Error\(|recv", e) for e in errors), errors


def fails_then_reloads(server, started: float) -> None:
    """The model reads not-ready quickly, and a reload (the operator's header) serves again."""
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        wait_until(lambda: not client.is_model_ready(MODEL), 10, "the model not ready after the tampering")
        print(f"not ready {time.monotonic() - started:.2f} s after the tampering was read")
        client.load_model(MODEL, headers=server.admin_headers())
        assert client.is_model_ready(MODEL)
    assert len(stream(server.grpc_url, tiny_request(num_frames=21), timeout=60)) == 2


def test_a_foreign_doorbell_value_fails_an_idle_group_at_the_next_request(sp2) -> None:
    # Written by someone who learnt the secret (or by a bug): the next request reads it.
    store_client("127.0.0.1", sp2.rendezvous_port, sp2.group_secret, 10).set("doorbell", b"garbage")
    started = time.monotonic()
    with pytest.raises(StreamError) as failed:
        stream(sp2.grpc_url, tiny_request(num_frames=9), timeout=30)
    assert time.monotonic() - started < TIMEOUT_S, "the request waited for a timeout instead of failing at once"
    assert_plain([str(failed.value)])
    fails_then_reloads(sp2, started)


def test_a_foreign_doorbell_value_fails_a_busy_group_and_its_open_streams(sp2) -> None:
    before = metrics(sp2).get("lingbot_world_blocks_total", 0)
    threads, errors = stream_in_background(sp2.grpc_url, range(2), TIMEOUT_S + 30, num_frames=321)  # 27 blocks
    wait_until(lambda: metrics(sp2).get("lingbot_world_blocks_total", 0) > before + 1, 60, "streams running")
    store_client("127.0.0.1", sp2.rendezvous_port, sp2.group_secret, 10).set("doorbell", b"-7")
    started = time.monotonic()
    for t in threads:
        t.join()
    assert len(errors) == 2
    assert_plain(errors)
    fails_then_reloads(sp2, started)


def test_docker_compose_opens_the_ports_on_purpose_and_restricts_like_the_launcher(tmp_path: Path) -> None:
    from backend.launch.server import TritonServer

    compose = (Path(__file__).resolve().parent.parent / "docker-compose.yml").read_text()
    command = TritonServer(tmp_path, address="0.0.0.0", admin_key="KEY").command()
    flags = [f.replace("=KEY", "=$$key") for f in command if re.match(r"--(http|grpc|metrics)-(address|restricted)", f)]
    assert len(flags) == 5
    for flag in flags:
        assert flag in compose, flag
    assert "LINGBOT_GROUP_SECRET=" in compose


def test_a_doorbell_that_reads_a_foreign_value_raises_and_its_ring_wakes_the_waiters() -> None:
    import threading

    import torch.distributed as dist

    from backend.parallel.doorbell import GroupTampered, StoreDoorbell

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ringer, waiter = (StoreDoorbell("127.0.0.1", server.port, "s3cret", 10) for _ in range(2))
    ringer.ring()
    assert waiter.count() == 1 and waiter.wait(1, 1)
    # Each rank's loop waits for the same ring (2) on its own doorbell; rank A's execute thread then rings.
    woke: list[bool] = []
    loops = [threading.Thread(target=lambda d=d: woke.append(d.wait(2, 30))) for d in (ringer, waiter)]
    for loop in loops:
        loop.start()
    wait_until(lambda: ringer._awaited == 2, 10, "rank A's loop waiting")
    store_client("127.0.0.1", server.port, "s3cret", 10).set("doorbell", b"garbage")
    started = time.monotonic()
    ringer.ring()  # never raises to Triton's execute thread ...
    for loop in loops:
        loop.join(10)
    assert woke == [True, True] and time.monotonic() - started < 5  # ... and wakes every waiting loop at once
    for doorbell in (ringer, waiter):
        with pytest.raises((GroupTampered, dist.DistNetworkError)):
            doorbell.count()
    store_client("127.0.0.1", server.port, "s3cret", 10).set("doorbell", b"5")
    fresh = StoreDoorbell("127.0.0.1", server.port, "s3cret", 10)
    assert fresh.count() == 5
    store_client("127.0.0.1", server.port, "s3cret", 10).set("doorbell", b"2")
    with pytest.raises(GroupTampered, match="went back from 5 to 2"):
        fresh.count()


def test_the_admin_key_file_is_readable_by_its_owner_only(tmp_path: Path) -> None:
    from backend.launch.launcher import build_parser, write_admin_key

    path = tmp_path / "keys" / "admin.key"
    args = build_parser().parse_args(["--admin-key-file", str(path)])
    assert args.address == "127.0.0.1"  # the launcher's default: this host only
    write_admin_key(args.admin_key_file, "KEY")
    write_admin_key(args.admin_key_file, "KEY2")  # a restart replaces it
    assert path.read_text() == "lingbot-admin-key: KEY2\n"
    assert path.stat().st_mode & 0o777 == 0o600
