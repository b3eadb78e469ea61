"""The golden rollout (tests/golden.py): the engine's latents on the tiny checkpoint against stored ones, within
float32 rounding on any CPU and bit for bit on the CPU kernel family and torch that wrote them."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import golden
from backend.engine.rollout import WorldModelEngine
from factories import tiny_request

REGENERATE = "if the model is meant to change, regenerate both with `.venv/bin/python tests/golden.py --write`"


@pytest.fixture(scope="module")
def now(engine: WorldModelEngine, one_torch_thread) -> dict[str, np.ndarray]:
    return golden.rollouts(engine, tiny_request())


def test_the_stored_latents_are_what_their_command_wrote() -> None:
    """A change to the data alone (not by `golden.py --write`, which pins its SHA-256) fails."""
    assert golden.file_sha256() == golden.PINNED.read_text().strip(), f"{golden.DATA} differs from {golden.PINNED}: " \
        + REGENERATE


@pytest.mark.parametrize("run", ["steered", "whole"])
def test_the_rollout_gives_the_golden_latents(now: dict[str, np.ndarray], run: str) -> None:
    stored, writer = golden.load()
    assert now[run].shape == stored[run].shape
    per_block = np.abs(now[run] - stored[run]).reshape(len(stored[run]), -1).max(axis=1)
    print(f"{run}: max abs diff per block {per_block.tolist()} (written on {writer}, run on {golden.machine()})")
    assert per_block.max() <= golden.ATOL, f"blocks {np.flatnonzero(per_block > golden.ATOL).tolist()} differ: " \
        + REGENERATE
    if writer == golden.machine():
        assert np.array_equal(now[run], stored[run]), "the same CPU kernels and torch give other bits"


def test_the_golden_run_covers_its_event_and_its_recache(engine: WorldModelEngine, now: dict[str, np.ndarray],
                                                         one_torch_thread) -> None:
    """The prompt event before block 2 and the recache before block 4 each shape the blocks from theirs on, and only
    those: without one, the blocks before it keep every bit and its block moves beyond the tolerance, tenfold."""
    request = tiny_request()
    for at in (2, 4):
        step = golden.STEERED[at]
        if step.recache:  # the same event without its recache
            plain = dataclasses.replace(step, recache=False)
        else:
            plain = dataclasses.replace(step, event=None)
        steps = golden.STEERED[:at] + (plain,) + golden.STEERED[at + 1:]
        other = golden.steered_latents(engine, request, steps)
        assert np.array_equal(other[:at], now["steered"][:at])
        assert np.abs(other[at] - now["steered"][at]).max() > 10 * golden.ATOL  # the recache: 3.5e-3
