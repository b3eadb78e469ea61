"""The tritonserver, Python backend and stubs shipped in the nvidia-pytriton wheel, laid out to run."""
from __future__ import annotations

import filecmp
import os
import shutil
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from .paths import DEFAULT_BACKENDS_DIR


@dataclass(frozen=True)
class PytritonWheel:
    """Paths inside an installed nvidia-pytriton wheel."""

    site_packages: Path

    @property
    def server_dir(self) -> Path:
        return self.site_packages / "pytriton" / "tritonserver"

    @property
    def binary(self) -> Path:
        return self.server_dir / "bin" / "tritonserver"

    @property
    def libs_dir(self) -> Path:
        return self.site_packages / "nvidia_pytriton.libs"

    @property
    def python_backend_dir(self) -> Path:
        return self.server_dir / "backends" / "python"

    def stub(self, python_version: str) -> Path:
        return self.server_dir / "python_backend_stubs" / python_version / "triton_python_backend_stub"

    def lib(self, pattern: str) -> Path:
        """The one shared library in `libs_dir` matching a glob pattern (the wheel hashes the names)."""
        matches = sorted(self.libs_dir.glob(pattern))
        if len(matches) != 1:
            raise FileNotFoundError(f"expected one {pattern} in {self.libs_dir}, found {len(matches)}")
        return matches[0]


def find_pytriton_wheel() -> PytritonWheel:
    """Locate nvidia-pytriton in the current interpreter's site-packages."""
    candidates = {Path(sysconfig.get_paths()[key]) for key in ("purelib", "platlib")}
    for site_packages in sorted(candidates):
        wheel = PytritonWheel(site_packages)
        if wheel.binary.is_file():
            return wheel
    raise FileNotFoundError(
        f"no tritonserver binary under {sorted(map(str, candidates))}; "
        f"install it with: {sys.executable} -m pip install nvidia-pytriton==0.7.0"
    )


def _python_version() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def _copy_if_changed(src: Path, dst: Path) -> None:
    # Skip identical files; replace others by a rename, never in place: a running server may execute the
    # stub (ETXTBSY), and servers started at once on one host (mpirun) share this directory.
    if not (dst.is_file() and filecmp.cmp(src, dst, shallow=True)):
        partial = dst.with_name(f".{dst.name}.{os.getpid()}")
        shutil.copy2(src, partial)
        os.replace(partial, dst)


def prepare_backends(out_dir: Path = DEFAULT_BACKENDS_DIR, wheel: PytritonWheel | None = None) -> Path:
    """Build `out_dir/python/` (python backend + this interpreter's stub); returns `out_dir`."""
    wheel = wheel or find_pytriton_wheel()
    stub = wheel.stub(_python_version())
    if not stub.is_file():
        raise FileNotFoundError(f"nvidia-pytriton has no Python backend stub for Python {_python_version()}")
    python_dir = out_dir / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    for src in [p for p in wheel.python_backend_dir.iterdir() if p.is_file()] + [stub]:
        _copy_if_changed(src, python_dir / src.name)
    return out_dir
