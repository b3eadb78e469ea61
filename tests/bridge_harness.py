"""The browser bridge (`python -m client serve`) as a user starts it, in its own process on loopback."""
from __future__ import annotations

import contextlib
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from backend.parallel.ports import free_port
from polling import wait_until

ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def running_bridge(triton_url: str, log: Path, *args: str) -> Iterator[str]:
    """`python -m client serve` against `triton_url` with `args`; yields its base URL; its output goes to `log`."""
    port = free_port()
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "client", "serve", "--url", triton_url, "--port", str(port),
                                 *args], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: answers(base + "/") or proc.poll() is not None, 60, "the bridge to serve its page")
        assert proc.poll() is None, log.read_text()
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def answers(url: str) -> bool:
    with contextlib.suppress(OSError):
        return urllib.request.urlopen(url, timeout=2).status == 200
    return False
