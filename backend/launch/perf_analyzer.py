"""The real perf_analyzer binary (from the tritonclient 2.41.0 wheel) beside the libraries it needs."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from .paths import DEFAULT_PERF_ANALYZER_DIR
from .wheel import PytritonWheel, find_pytriton_wheel

PERF_ANALYZER_WHEEL = "tritonclient==2.41.0"  # the last wheel that ships the perf_analyzer binary


def install_perf_analyzer(dest: Path = DEFAULT_PERF_ANALYZER_DIR, wheel: PytritonWheel | None = None) -> Path:
    """Put the perf_analyzer binary in `dest` beside plain-named links to the libraries it needs.

    Run it with `perf_analyzer_environment(dest)` (LD_LIBRARY_PATH=dest).
    """
    wheel = wheel or find_pytriton_wheel()
    dest.mkdir(parents=True, exist_ok=True)
    binary = dest / "perf_analyzer"
    if not binary.is_file():
        _extract_perf_analyzer(binary)
    for plain, pattern in (("libcudart.so.12", "libcudart-*.so.12*"), ("libb64.so.0d", "libb64-*.so.0d")):
        link = dest / plain
        link.unlink(missing_ok=True)
        link.symlink_to(wheel.lib(pattern))
    return binary


def _extract_perf_analyzer(binary: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        download = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--dest", tmp, PERF_ANALYZER_WHEEL]
        if subprocess.run(download, check=False).returncode != 0:
            raise RuntimeError(f"`{' '.join(download)}` failed; is the package index reachable?")
        (wheel_file,) = Path(tmp).glob("tritonclient-*.whl")
        with zipfile.ZipFile(wheel_file) as archive:
            member = next(n for n in archive.namelist() if n.endswith(".data/data/bin/perf_analyzer"))
            binary.write_bytes(archive.read(member))
    binary.chmod(0o755)


def perf_analyzer_environment(dest: Path = DEFAULT_PERF_ANALYZER_DIR) -> dict[str, str]:
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(dest), env.get("LD_LIBRARY_PATH")]))
    return env
