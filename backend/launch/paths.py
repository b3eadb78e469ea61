"""Where the checkout keeps its model repository (model.py) and what the launcher builds."""
from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
TEMPLATE_DIR = REPO_ROOT / "model_repository" / "lingbot_world"
BUILD_DIR = REPO_ROOT / "build"
DEFAULT_BACKENDS_DIR = BUILD_DIR / "triton_backends"
DEFAULT_REPOSITORY_DIR = BUILD_DIR / "model_repository"
DEFAULT_PERF_ANALYZER_DIR = REPO_ROOT / "tools" / "perf_analyzer"
