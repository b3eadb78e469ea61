"""The command lines a user runs first: scripts/run_demo.sh (a failed start is a failure, never "ready"; busy ports
refused by name) and the tiny checkpoint writer (no progress bar through `>/dev/null`)."""
from __future__ import annotations

import pytest
import os
import socket
import subprocess
import sys
from pathlib import Path

from backend.parallel.ports import free_port

pytestmark = pytest.mark.server  # runs the demo script and the launcher

ROOT = Path(__file__).resolve().parent.parent


def run_demo(**env: str) -> subprocess.CompletedProcess:
    ports = {"GRPC_PORT": str(free_port()), "HTTP_PORT": str(free_port()), "METRICS_PORT": str(free_port())}
    return subprocess.run(["bash", "scripts/run_demo.sh"], cwd=ROOT, env=os.environ | ports | env,
                          capture_output=True, text=True, timeout=300)


def test_a_busy_port_is_refused_by_name() -> None:
    with socket.socket() as listener:
        listener.bind(("", 0))
        listener.listen()
        port = listener.getsockname()[1]
        done = run_demo(GRPC_PORT=str(port))
    assert done.returncode == 1
    assert f"port {port} (GRPC_PORT) is in use on this host" in done.stderr
    assert "ready" not in done.stdout


def test_a_launcher_that_fails_is_a_failure_not_ready() -> None:
    done = run_demo(SP="0")  # the launcher's usage error (exit status 2) names --sp
    assert done.returncode == 1
    assert "the server failed to start (launcher exit status 2)" in done.stderr
    assert "argument --sp: instances must be >= 1, got 0" in done.stderr and "server ready" not in done.stdout


def test_writing_the_tiny_checkpoint_prints_no_progress_bar(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "backend.model.tiny_checkpoint", str(tmp_path / "tiny")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == str(tmp_path / "tiny")
    assert "Writing model shards" not in done.stderr and "it/s" not in done.stderr, done.stderr
