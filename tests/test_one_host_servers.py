"""Two SP2 servers on one host, both launched with the defaults: each picks its own rendezvous port and both
serve (with one fixed default port the second would join or wait on the first one's store)."""
from __future__ import annotations

import pytest
import subprocess
import sys
import urllib.request
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from backend.api import contract
from backend.parallel.ports import free_port
from factories import TINY_SIZE
from polling import wait_until

pytestmark = [pytest.mark.server, pytest.mark.slow]  # starts real tritonservers


def ready(http_port: int) -> bool:
    try:
        url = f"http://127.0.0.1:{http_port}/v2/models/{contract.MODEL_NAME}/ready"
        return urllib.request.urlopen(url, timeout=5).status == 200
    except OSError:
        return False


def rendezvous_port(repository: Path) -> str:
    config = text_format.Parse((repository / contract.MODEL_NAME / "config.pbtxt").read_text(),
                               model_config_pb2.ModelConfig())
    return config.parameters["rendezvous_port"].string_value


def test_a_second_server_on_one_host_gets_its_own_rendezvous(tmp_path: Path, tiny_checkpoint: str) -> None:
    launchers, http_ports = [], []
    try:
        for name in ("first", "second"):
            http_ports.append(free_port())
            command = [sys.executable, "-m", "backend.launch", "--kind", "cpu", "--sp", "2",
                       "--grpc-port", str(free_port()), "--http-port", str(http_ports[-1]),
                       "--metrics-port", str(free_port()), "--repository-out", str(tmp_path / name),
                       "--log-file", str(tmp_path / f"{name}.log"), "--param", f"checkpoint={tiny_checkpoint}",
                       "--param", "dtype=float32", "--param", f"default_height={TINY_SIZE}",
                       "--param", f"default_width={TINY_SIZE}"]
            launchers.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        for launcher, port in zip(launchers, http_ports):
            wait_until(lambda p=port, proc=launcher: ready(p) or proc.poll() is not None, 300,
                       f"the server on {port} to be ready")
            assert launcher.poll() is None, launcher.stderr.read().decode()
        ports = {rendezvous_port(tmp_path / name) for name in ("first", "second")}
        assert len(ports) == 2
    finally:
        for launcher in launchers:
            launcher.terminate()
        for launcher in launchers:
            launcher.wait(timeout=60)
