"""Servers under `mpirun`: one launcher and tritonserver per rank, all in one group (multi-host tests)."""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from backend.launch.mpi import SET_BY_MPI
from backend.parallel.local import free_port
from polling import wait_until
from triton_harness import tiny_parameters

# mpirun refuses root without both (CI runs as root).
MPIRUN_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
_STARTED = re.compile(r"tritonserver pid (\d+) grpc \S+ log (\S+?\.log)")  # two ranks may print on one line


@dataclass(frozen=True)
class RankServer:
    """One rank's server as a client on its network sees it."""

    url: str  # gRPC host:port
    metrics_url: str
    pid: int  # tritonserver (its process group holds the Python stubs)
    log_path: Path


def _launcher_args(tmp: Path, rank: int, address: str, parameters: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """One rank's launcher command (its own ports and paths: ranks may share a host or a file system)."""
    ports = {name: free_port() for name in ("grpc", "http", "metrics")}
    args = [sys.executable, "-m", "backend.launch", "--mpi", "--kind", "cpu", "--sp", "1", "--wait", "--address", address]
    args += [a for key, value in parameters.items() for a in ("--param", f"{key}={value}")]
    args += [f"--{name}-port={port}" for name, port in ports.items()]
    log = tmp / f"tritonserver_rank{rank}.log"
    args += ["--repository-out", str(tmp / f"repo_rank{rank}"), "--log-file", str(log)]
    where = {"url": f"{address}:{ports['grpc']}", "metrics_url": f"http://{address}:{ports['metrics']}/metrics"}
    return args, where | {"log": str(log)}


@contextlib.contextmanager
def mpirun_servers(
    tmp: Path,
    checkpoint: str,
    addresses: Sequence[str] = ("127.0.0.1", "127.0.0.1"),
    mpirun_prefix: Sequence[str] = (),
    mpirun_args: Sequence[str] = (),
    **overrides: str,
) -> Iterator[list[RankServer]]:
    """One rank per address (a CPU instance each) under one `mpirun`; yields the servers in rank order once
    every model is ready. `--enable-recovery` keeps the other ranks running when one dies, as in production."""
    # The launcher sets these: sp_degree (instances x host_count), and under --mpi the host's place and rank 0's address.
    parameters = {k: v for k, v in tiny_parameters(checkpoint, 1, **overrides).items()
                  if k not in ("sp_degree", *SET_BY_MPI, "rendezvous_host")}
    ranks = [_launcher_args(tmp, r, a, parameters) for r, a in enumerate(addresses)]
    command = [*mpirun_prefix, "mpirun", "--oversubscribe", "--bind-to", "none", "--enable-recovery", *mpirun_args]
    for i, (args, _) in enumerate(ranks):
        command += ([":"] if i else []) + ["-np", "1", *args]
    output = tmp / "mpirun.out"
    with output.open("wb") as out:
        mpirun = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=os.environ | MPIRUN_ENV,
                                  start_new_session=True, cwd=Path(__file__).resolve().parent.parent)
    started: dict[str, int] = {}
    try:
        def ready() -> bool:
            text = output.read_text(errors="replace")
            if mpirun.poll() is not None:
                raise AssertionError(f"mpirun exited with {mpirun.returncode}:\n{text[-4000:]}")
            started.update({log: int(pid) for pid, log in _STARTED.findall(text)})
            return text.count(" ready (") == len(ranks)

        wait_until(ready, 240, "every rank's model ready", interval=0.5)
        yield [RankServer(w["url"], w["metrics_url"], started[w["log"]], Path(w["log"])) for _, w in ranks]
    finally:
        _stop(mpirun, started.values())


def _stop(mpirun: subprocess.Popen, servers: Iterable[int]) -> None:
    """SIGTERM mpirun (it stops the launchers, which stop their servers); SIGKILL whatever outlives it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(mpirun.pid, signal.SIGTERM)
    try:
        mpirun.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(mpirun.pid, signal.SIGKILL)
        mpirun.wait()
    for pid in servers:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
