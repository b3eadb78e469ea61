"""The browser bridge (`python -m client serve`) as a user starts it, in its own process (on loopback by default)."""
from __future__ import annotations

import contextlib
import ssl
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from backend.parallel.ports import free_port
from polling import wait_until

ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def running_bridge(triton_url: str, log: Path, *args: str, https_ca: Path | None = None,
                   host: str = "127.0.0.1") -> Iterator[str]:
    """`python -m client serve --host host` against `triton_url` with `args`; yields its base URL; its output goes to
    `log`. https_ca: the bridge serves HTTPS (its args name a certificate for localhost) that this CA signed."""
    port = free_port()
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "client", "serve", "--url", triton_url, "--host", host,
                                 "--port", str(port), *args], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    base = f"https://localhost:{port}" if https_ca else f"http://{host}:{port}"
    context = ssl.create_default_context(cafile=str(https_ca)) if https_ca else None
    try:
        wait_until(lambda: answers(base + "/", context) or proc.poll() is not None, 60, "the bridge to serve its page")
        assert proc.poll() is None, log.read_text()
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def answers(url: str, context: ssl.SSLContext | None = None) -> bool:
    with contextlib.suppress(OSError):
        return urllib.request.urlopen(url, timeout=2, context=context).status == 200
    return False
