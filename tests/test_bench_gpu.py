"""The GPU benchmark's random-weights mode: its FLOP model, its weights, and a CPU dry run of the whole script."""
from __future__ import annotations

import contextlib
import io

import pytest
import torch

from backend.model.config import TransformerConfig
from backend.model.random_weights import random_transformer
from backend.model.tiny_checkpoint import PRESETS, transformer_config
from bench import gpu
from bench.flops import block_keys, forward_flops


def test_flop_model_of_the_14b_full_window_forward() -> None:
    """480x832: 3 x 30 x 52 = 4,680 tokens per block over 18 x 1,560 = 28,080 keys (the issue's numbers)."""
    cfg = TransformerConfig.lingbot_14b()
    keys = block_keys(5, 3, 18, 30 * 52)
    assert keys == 28_080 and block_keys(0, 3, 18, 1560) == 3 * 1560
    flops = forward_flops(cfg, 3 * 30 * 52, keys)
    assert flops.total / 1e12 == pytest.approx(261, abs=5)
    assert flops.linear / 1e12 == pytest.approx(112, abs=1)
    assert flops.camera / 1e12 == pytest.approx(40, abs=1)
    # The camera branch runs once a block: 5 forwards are 5 x 261 less 4 x 40 (the reference's block: 1,307).
    assert flops.block(5) / 1e12 == pytest.approx(1147, abs=2)
    assert 5 * flops.total / 1e12 == pytest.approx(1307, abs=2)
    assert flops.self_attention / 1e12 == pytest.approx(108, abs=1)
    assert flops.cross_attention / 1e12 == pytest.approx(2, abs=0.1)


def test_random_transformer_is_deterministic_and_fully_materialised() -> None:
    cfg = transformer_config(PRESETS["tiny"])
    a = random_transformer(cfg, torch.bfloat16, torch.device("cpu"), seed=3)
    b = random_transformer(cfg, torch.bfloat16, torch.device("cpu"), seed=3)
    state = a.state_dict()
    assert all(t.device.type == "cpu" and t.dtype == torch.bfloat16 for t in state.values())
    assert all(torch.equal(t, b.state_dict()[name]) for name, t in state.items())
    assert torch.equal(state["blocks.0.self_attn.norm_q.weight"], torch.ones(cfg.dim, dtype=torch.bfloat16))
    assert not state["blocks.0.ffn.0.bias"].any()
    assert state["blocks.0.ffn.0.weight"].float().std().item() == pytest.approx(0.02, rel=0.1)


def test_dry_run_prints_every_row() -> None:
    """The script's own code path on CPU: tiny preset, 64x64, 3 blocks (the last one fills the window)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        gpu.main(["--random-weights", "--dry-run", "--modes", "eager", "--warmup-blocks", "1", "--profile",
                  "--profile-rows", "5"])
    text = out.getvalue()
    assert "prompt encoder: random stand-in states [1, 16, 32]" in text
    header = next(line for line in text.splitlines() if line.startswith("| block "))
    for column in ("denoise 1 (ms)", "denoise 4 (ms)", "commit (ms)", "5 forwards (ms)", "condition encode (ms)",
                   "run_block (ms)", "TFLOP/s (forwards)", "VAE decode (ms)"):
        assert column in header
    assert "denoise 5" not in header
    block_rows = [line for line in text.splitlines() if line.startswith(("| 0 ", "| 1 ", "| 2 "))]
    assert [row.split("|")[2].strip() for row in block_rows] == ["48", "96", "144"]  # keys: 16 tokens a frame

    summary = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
               for line in text.splitlines() if line.startswith("| ") and not line.startswith("| block")}
    assert summary[""] == ["eager", "reference (H200, compiled)"]
    assert summary["full-window block: run_block, median (ms)"][1] == "2,397"
    assert summary["whole request (s)"][1] == "17.7"
    assert summary["peak allocated (GiB)"] == ["n/a (CPU)", "69.3"]
    assert summary["peak reserved (GiB)"][0] == "n/a (CPU)"
    assert summary["fraction of 790 TFLOP/s"] == ["n/a (CPU)", "69%"]
    for row in ("full-window block: 5 forwards, median (ms)", "full-window block: commit forward, median (ms)",
                "VAE decode per block, median (ms)", "achieved TFLOP/s (full-window run_block)"):
        assert float(summary[row][0].replace(",", "")) > 0
    assert summary["VAE decode overlapped with the DiT"][0].endswith("of its time")
    assert "profile of block 2 (full window)" in text
    assert "attention kernels in the profile: aten::" in text
