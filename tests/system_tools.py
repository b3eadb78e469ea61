"""System tools some tests need (Open MPI's mpirun, Chromium, iproute2's ip). Missing, such a test skips; under
scripts/test.sh, which installs them and sets LINGBOT_REQUIRE_TOOLS=1, the skip is a failure (conftest.py)."""
from __future__ import annotations

import os

import pytest

REQUIRE_TOOLS = "LINGBOT_REQUIRE_TOOLS"
MISSING = "missing system tool: "


def tools_required() -> bool:
    return os.environ.get(REQUIRE_TOOLS) == "1"


def requires_tool(available: bool, what: str) -> pytest.MarkDecorator:
    """A mark that skips the test (before any fixture starts) when `what` is missing."""
    return pytest.mark.skipif(not available, reason=f"{MISSING}{what} (scripts/test.sh installs it)")


def require_tool(available: bool, what: str) -> None:
    """The same, checked inside a running test."""
    if not available:
        pytest.skip(f"{MISSING}{what} (scripts/test.sh installs it)")
