"""One torch for every path: pyproject.toml pins its version, the venv runs that version, and no other file that
installs torch (the compose images, the scripts, CI) names a version of its own."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
INSTALLERS = ["docker-compose.yml", ".ci/run", *(str(p.relative_to(ROOT)) for p in sorted(ROOT.glob("scripts/*.sh"))),
              *(str(p.relative_to(ROOT)) for p in sorted(ROOT.glob("bench/*.sh")))]


def pinned() -> str:
    done = subprocess.run(["bash", "scripts/torch_version.sh"], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_the_tests_run_the_pinned_torch() -> None:
    assert torch.__version__.split("+")[0] == pinned()


def test_no_installer_names_a_torch_version_of_its_own() -> None:
    named = {path: found for path in INSTALLERS
             if (found := re.findall(r"torch\s*[=<>~!]=\s*[0-9]", (ROOT / path).read_text()))}
    assert not named, named
