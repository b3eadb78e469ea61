"""One group across tritonservers under `mpirun` (one server per host in production): on this machine with
different ports, and across two network namespaces joined by a veth pair, so nothing relies on loopback."""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from backend.api import contract
from backend.launch.metrics_page import metrics_page, samples
from factories import tiny_request
from mpi_harness import MPIRUN_ENV, RankServer, mpirun_servers
from polling import wait_until
from system_tools import require_tool, requires_tool
from triton_harness import latents_of, stream, stream_in_background

SEEDS = (0, 1)  # one request per server
TIMEOUT_S = 5  # collective_timeout_s of the groups under test
pytestmark = [pytest.mark.server, pytest.mark.slow,
              requires_tool(shutil.which("mpirun") is not None, "Open MPI's mpirun (Debian's openmpi-bin)")]


@pytest.fixture(scope="module")
def references(sp1_server, sp2_server) -> dict[int, np.ndarray]:
    """Each seed's latents from one SP1 server and from one SP2 server (bit-identical, else this fails)."""
    sp1 = {seed: latents_of(stream(sp1_server.grpc_url, tiny_request(seed=seed))) for seed in SEEDS}
    for seed in SEEDS:
        assert np.array_equal(latents_of(stream(sp2_server.grpc_url, tiny_request(seed=seed))), sp1[seed]), seed
    return sp1


@pytest.fixture(scope="module")
def mpi_servers(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: str) -> Iterator[list[RankServer]]:
    """Two ranks on this machine, one CPU instance and its own ports each; the kill test ends the group, so
    it runs last."""
    with mpirun_servers(tmp_path_factory.mktemp("mpi"), tiny_checkpoint, max_batch="1",
                        collective_timeout_s=str(TIMEOUT_S)) as servers:
        yield servers


def blocks_sent(server: RankServer, rank: int) -> float:
    return sum(samples(metrics_page(server.metrics_url, 10), "lingbot_world_blocks_total", rank=str(rank)))


def test_each_server_streams_its_requests_as_one_sp2_group(mpi_servers: list[RankServer], references) -> None:
    results: dict[int, np.ndarray] = {}

    def one(server: RankServer, seed: int) -> None:
        results[seed] = latents_of(stream(server.url, tiny_request(seed=seed)))

    threads = [threading.Thread(target=one, args=pair) for pair in zip(mpi_servers, SEEDS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == list(SEEDS)
    for seed in SEEDS:
        assert np.array_equal(results[seed], references[seed]), seed
    # One group of two global ranks; each server's own instance sent its blocks back.
    for rank, server in enumerate(mpi_servers):
        assert f"rank {rank}/2 ready" in server.log_path.read_text()
        assert blocks_sent(server, rank) > 0


@contextlib.contextmanager
def two_namespaces(tag: str) -> Iterator[tuple[str, str]]:
    """Network namespaces <tag>a (10.77.0.1) and <tag>b (10.77.0.2) joined by a veth pair named lbw0 in both;
    skips where namespaces cannot be made (not root, no iproute2, no CAP_SYS_ADMIN)."""
    names = (f"{tag}a", f"{tag}b")
    require_tool(shutil.which("ip") is not None, "iproute2's ip (Debian's iproute2)")
    made = subprocess.run(["ip", "netns", "add", names[0]], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot create a network namespace here: {made.stderr.strip()}")
    try:
        setup = [
            ["ip", "netns", "add", names[1]],
            ["ip", "link", "add", "lbw0", "netns", names[0], "type", "veth", "peer", "name", "lbw0", "netns", names[1]],
        ]
        for i, ns in enumerate(names):
            setup += [["ip", "-n", ns, "addr", "add", f"10.77.0.{i + 1}/24", "dev", "lbw0"],
                      ["ip", "-n", ns, "link", "set", "lbw0", "up"], ["ip", "-n", ns, "link", "set", "lo", "up"]]
        for step in setup:
            subprocess.run(step, check=True, capture_output=True)
        yield names
    finally:
        for ns in names:  # deleting a namespace deletes its end of the veth pair, and so the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.mark.parametrize(
    ("rank_args", "message"),
    [
        ([["--param", "checkpoint=/a"], ["--param", "checkpoint=/b"]],
         r"configured alike; differing: checkpoint \(ranks \[1\]\)"),
        ([[], []], "2 ranks on one host share grpc_port=8001"),
    ],
    ids=["different_config", "same_ports_on_one_host"],
)
def test_mpi_launch_rejects_what_cannot_form_one_group(tmp_path: Path, rank_args: list[list[str]], message: str) -> None:
    command = ["mpirun", "--oversubscribe"]
    for rank, args in enumerate(rank_args):
        command += [":"] * (rank > 0) + ["-np", "1", sys.executable, "-m", "backend.launch", "--mpi", "--render-only",
                                          "--kind", "cpu", "--repository-out", str(tmp_path / f"r{rank}"), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=os.environ | MPIRUN_ENV)
    assert done.returncode != 0
    assert len(re.findall(message, done.stderr)) == 2, done.stderr  # every rank says why


def test_group_across_two_network_namespaces(tmp_path: Path, tiny_checkpoint: str, references) -> None:
    addresses = ("10.77.0.1", "10.77.0.2")
    with two_namespaces(f"lbw{os.getpid() % 100000}") as namespaces:
        # mpirun's remote shell: "ssh HOST COMMAND" becomes COMMAND inside HOST's namespace.
        agent = tmp_path / "netns_rsh"
        cases = "".join(f"  {a}) ns={n} ;;\n" for a, n in zip(addresses, namespaces))
        agent.write_text(f'#!/bin/sh\nhost=$1; shift\ncase "$host" in\n{cases}  *) exit 1 ;;\nesac\n'
                         'exec ip netns exec "$ns" sh -c "$*"\n')
        agent.chmod(0o755)
        hostfile = tmp_path / "hosts"
        hostfile.write_text("".join(f"{a} slots=1\n" for a in addresses))
        in_a = ["ip", "netns", "exec", namespaces[0]]
        mpirun_args = ["--hostfile", str(hostfile), "--mca", "plm_rsh_agent", str(agent),
                       "--mca", "oob_tcp_if_include", "lbw0", "--mca", "btl_tcp_if_include", "lbw0",
                       "-x", "GLOO_SOCKET_IFNAME=lbw0"]
        with mpirun_servers(tmp_path, tiny_checkpoint, addresses, in_a, mpirun_args, max_batch="1") as servers:
            # The rendezvous is rank 0's address on the shared link, learnt through MPI.
            assert all('"rendezvous_host", value: { string_value: "10.77.0.1" }' in
                       (tmp_path / f"repo_rank{r}" / contract.MODEL_NAME / "config.pbtxt").read_text()
                       for r in range(2))
            # Clients in namespace a: one stream to each server, rank 1's across the veth pair.
            clients = [subprocess.Popen([*in_a, sys.executable, str(Path(__file__).with_name("stream_latents.py")),
                                         server.url, str(seed), str(tmp_path / f"latents_{seed}.npy")])
                       for server, seed in zip(servers, SEEDS)]
            assert [c.wait(180) for c in clients] == [0, 0]
    for seed in SEEDS:
        assert np.array_equal(np.load(tmp_path / f"latents_{seed}.npy"), references[seed]), seed


def fail_one_server(servers: list[RankServer], failure: signal.Signals) -> float:
    """Send `failure` to rank 1's server and stub while rank 0's server streams two sessions; assert those
    streams error and rank 0's model unloads; returns the seconds that took."""
    survivor, victim = servers
    threads, errors = stream_in_background(survivor.url, range(2), TIMEOUT_S + 30)
    before = blocks_sent(survivor, 0)
    wait_until(lambda: blocks_sent(survivor, 0) > before, 60, "blocks streaming from the surviving server")
    os.killpg(victim.pid, failure)
    failed = time.monotonic()
    for t in threads:
        t.join()
    assert len(errors) == 2 and all("lost one of its model instances" in e for e in errors), errors
    with grpcclient.InferenceServerClient(survivor.url) as client:
        wait_until(lambda: not client.is_model_ready(contract.MODEL_NAME), 15, "the survivor's model unloaded")
    return time.monotonic() - failed


def test_silent_server_is_detected_within_the_collective_timeout(tmp_path: Path, tiny_checkpoint: str) -> None:
    # A stopped server closes no connection, like a host that lost power or its network: only the timeout tells.
    with mpirun_servers(tmp_path, tiny_checkpoint, collective_timeout_s=str(TIMEOUT_S)) as servers:
        try:
            seconds = fail_one_server(servers, signal.SIGSTOP)
            print(f"silent server: detected and unloaded after {seconds:.1f} s (timeout {TIMEOUT_S} s)")
            assert seconds < TIMEOUT_S + 15
        finally:
            os.killpg(servers[1].pid, signal.SIGCONT)


def test_killed_server_errors_the_other_servers_streams_and_unloads(mpi_servers: list[RankServer]) -> None:
    # Runs last: it ends the module's group. A crashed host's connections close, so this is quick.
    seconds = fail_one_server(mpi_servers, signal.SIGKILL)
    print(f"killed server: detected and unloaded after {seconds:.1f} s (timeout {TIMEOUT_S} s)")
    assert seconds < TIMEOUT_S + 15
