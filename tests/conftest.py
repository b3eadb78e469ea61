from __future__ import annotations

from pathlib import Path

import pytest

from backend.tiny_checkpoint import write_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random tiny checkpoint in the diffusers directory format, written once per test run."""
    return str(write_checkpoint(Path(tmp_path_factory.mktemp("ckpt")) / "tiny", "tiny", seed=0))
