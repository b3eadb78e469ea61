"""How fast servers start and come back, for one or more checkouts side by side (before and after a change).

    python -m bench.startup [--checkout before=../base] [--checkout after=.] [--runs 3]

Each checkout runs its own venv (`CHECKOUT/.venv/bin/python`) and its own code, through the command lines every
version has (`python -m backend.launch`, `python -m backend.fleet`); this script only starts them, watches over gRPC,
HAProxy's stats socket and /proc, and prints one table. Per checkout, on the tiny checkpoint, CPU instances:
- a stub's import CPU: user+sys seconds of `import backend.adapter.model` (what `1/model.py` imports);
- launcher start to ready, SP1 and SP2: from the launcher's exec to the model reading ready over gRPC;
- the stubs' CPU at ready (SP1): user+sys seconds of the stub process when the model first reads ready;
- healed after a killed stub (SP1, a lone launcher): SIGKILL to the model reading ready again;
- a fleet of 2 SP1 groups behind HAProxy: a killed stub's group back in the balancer's rotation (SIGKILL to UP),
  a group whole again after its launcher's SIGTERM (`backend.fleet restart`), a rolling restart of both groups.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import tritonclient.grpc as grpcclient

from backend.api.contract import MODEL_NAME
from backend.fleet.balancer import server_states
from backend.launch.wheel import prepare_backends
from backend.launch.polling import wait_for
from backend.launch.procfs import cpu_seconds, stub_pids, tritonserver_of
from backend.parallel.local import free_port
from bench.common import BUILD_DIR, TINY, engine_settings, ensure_checkpoint, format_table, server_parameters

POLL_S = 0.02  # how often a wait looks: the measure's resolution
TIMEOUT_S = 600.0


def wait(condition: Callable[[], object], what: str) -> None:
    wait_for(condition, TIMEOUT_S, what, every_s=POLL_S)


def ready(url: str) -> bool:
    try:
        with grpcclient.InferenceServerClient(url) as client:
            return client.is_model_ready(MODEL_NAME)
    except Exception:  # noqa: BLE001  (not up yet)
        return False


def params(checkpoint: Path, sp: int) -> list[str]:
    parameters = server_parameters(engine_settings(checkpoint, TINY, sp))
    parameters.pop("rendezvous_port")
    return [a for k, v in parameters.items() for a in ("--param", f"{k}={v}")]


def import_cpu_s(checkout: Path) -> float:
    code = ("import resource, backend.adapter.model; r = resource.getrusage(resource.RUSAGE_SELF); "
            "print(r.ru_utime + r.ru_stime)")
    stub_utils = prepare_backends() / "python"  # triton_python_backend_utils, from the one wheel
    out = subprocess.run([str(checkout / ".venv/bin/python"), "-c", code], cwd=checkout, check=True, text=True,
                         capture_output=True, env=os.environ | {"PYTHONPATH": str(stub_utils)})
    return float(out.stdout.split()[-1])


@contextlib.contextmanager
def launcher(checkout: Path, checkpoint: Path, sp: int, out: Path) -> Iterator[tuple[subprocess.Popen, str, float]]:
    """A lone launcher; yields (its process, its gRPC url, seconds from its exec to ready)."""
    grpc, http, metrics, agent = (free_port() for _ in range(4))
    out.mkdir(parents=True, exist_ok=True)
    command = [str(checkout / ".venv/bin/python"), "-m", "backend.launch", "--sp", str(sp), "--kind", "cpu",
               "--grpc-port", str(grpc), "--http-port", str(http), "--metrics-port", str(metrics),
               "--agent-port", str(agent), "--repository-out", str(out / "repo"), "--log-file",
               str(out / "tritonserver.log"), *params(checkpoint, sp), "--param", f"rendezvous_port={free_port()}"]
    url = f"127.0.0.1:{grpc}"
    with (out / "launcher.log").open("wb") as log:
        began = time.monotonic()
        process = subprocess.Popen(command, cwd=checkout, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    try:
        wait(lambda: ready(url) or process.poll() is not None, f"{checkout} SP{sp} ready")
        took = time.monotonic() - began
        if process.poll() is not None:
            raise RuntimeError(f"the launcher exited {process.returncode}: {out / 'launcher.log'}")
        yield process, url, took
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def lone_launcher(checkout: Path, checkpoint: Path, out: Path) -> dict[str, float]:
    row: dict[str, float] = {}
    with launcher(checkout, checkpoint, 1, out / "sp1") as (process, url, took):
        row["SP1 start to ready"] = took
        server = tritonserver_of(process.pid, int(url.rsplit(":", 1)[1]))
        assert server is not None
        stub = stub_pids(server)[0]
        row["stub CPU at ready"] = cpu_seconds(stub)
        os.kill(stub, signal.SIGKILL)
        killed = time.monotonic()
        wait(lambda: not ready(url) or stub_pids(server).get(0, stub) != stub, "the model's unload")
        wait(lambda: ready(url) and stub_pids(server).get(0, stub) != stub, "the heal")
        row["healed after a killed stub"] = time.monotonic() - killed
    with launcher(checkout, checkpoint, 2, out / "sp2") as (_, _, took):
        row["SP2 start to ready"] = took
    return row


def fleet(checkout: Path, checkpoint: Path, out: Path) -> dict[str, float]:
    python = str(checkout / ".venv/bin/python")
    out.mkdir(parents=True, exist_ok=True)
    command = [python, "-m", "backend.fleet", "--groups", "2", "--sp", "1", "--kind", "cpu",
               "--grpc-port", str(free_port()), "--out", str(out), *params(checkpoint, 1)]
    row: dict[str, float] = {}
    with (out / "fleet.log").open("wb") as log:
        process = subprocess.Popen(command, cwd=checkout, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait(lambda: "fleet ready" in (out / "fleet.log").read_text() or process.poll() is not None, "the fleet")
        if process.poll() is not None:
            raise RuntimeError(f"the fleet exited {process.returncode}: {out / 'fleet.log'}")
        manifest = json.loads((out / "fleet.json").read_text())
        socket, name = Path(manifest["stats_socket"]), manifest["groups"][0]["name"]
        group = manifest["groups"][0]
        server = tritonserver_of(group["launcher_pid"], group["grpc_port"])
        assert server is not None
        os.kill(stub_pids(server)[0], signal.SIGKILL)
        killed = time.monotonic()
        wait(lambda: server_states(socket).get(name) != "UP", f"{name} out of rotation")
        wait(lambda: server_states(socket).get(name) == "UP", f"{name} back in rotation")
        row["fleet: killed stub to back in rotation"] = time.monotonic() - killed
        for label, args in (("fleet: SIGTERM to whole again", ["restart", "--group", "0"]),
                            ("fleet: rolling restart of 2 groups", ["rolling-restart"])):
            began = time.monotonic()
            subprocess.run([python, "-m", "backend.fleet", *args, "--out", str(out)], cwd=checkout, check=True,
                           stdout=subprocess.DEVNULL)
            row[label] = time.monotonic() - began
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(120)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkout", action="append", metavar="LABEL=PATH",
                        help="a checkout with its own .venv (repeatable; default: this one, as 'this')")
    parser.add_argument("--runs", type=int, default=1, help="runs per checkout; the table gives the median")
    parser.add_argument("--out", type=Path, default=BUILD_DIR / "bench_startup")
    args = parser.parse_args()
    checkouts = [tuple(c.split("=", 1)) for c in args.checkout or [f"this={Path.cwd()}"]]
    checkpoint = ensure_checkpoint(None, "tiny").resolve()
    measured: dict[str, list[dict[str, float]]] = {label: [] for label, _ in checkouts}
    for run in range(args.runs):
        for label, path in checkouts:  # interleaved: each run's load falls on every checkout alike
            checkout, out = Path(path).resolve(), args.out / f"{label}_{run}"
            row = {"stub import CPU": import_cpu_s(checkout)}
            row |= lone_launcher(checkout, checkpoint, out)
            row |= fleet(checkout, checkpoint, out / "fleet")
            measured[label].append(row)
            print(label, run, {k: round(v, 2) for k, v in row.items()}, flush=True)
    labels = [label for label, _ in checkouts]
    names = list(measured[labels[0]][0])
    rows = []
    for name in names:
        medians = [statistics.median(r[name] for r in measured[label]) for label in labels]
        ratio = [f"{medians[-1] / medians[0]:.2f}"] if len(labels) > 1 else []
        rows.append([f"{name} (s)", *(f"{m:.2f}" for m in medians), *ratio])
    header = ["measure", *labels, *([f"{labels[-1]}/{labels[0]}"] if len(labels) > 1 else [])]
    print(format_table(header, rows))


if __name__ == "__main__":
    sys.exit(main())
