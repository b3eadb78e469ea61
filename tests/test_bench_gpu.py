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
from bench.gpu_random_weights import BF16_MATMUL_TFLOPS, REFERENCE, REFERENCE_BLOCK_FLOP


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


def cells(line: str) -> list[str]:
    return [c.strip() for c in line.split("|")[1:-1]]


def number(cell: str) -> float:
    return float(cell.replace(",", ""))


def test_dry_run_prints_every_row() -> None:
    """The script's own code path on CPU: tiny preset, 64x64, 3 blocks (the last one fills the window). Its
    numbers hold together: each block's FLOP from bench.flops at its keys, its five forwards the sum of its denoise
    steps and commit and no more than its run_block, its TFLOP/s their quotient; the reference column is
    REFERENCE and what the FLOP model makes of it."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        gpu.main(["--random-weights", "--dry-run", "--modes", "eager", "--warmup-blocks", "1", "--profile",
                  "--profile-rows", "5"])
    text = out.getvalue()
    assert "prompt encoder: random stand-in states [1, 16, 32]" in text
    lines = text.splitlines()
    header = cells(next(line for line in lines if line.startswith("| block ")))
    assert header == ["block", "keys", "denoise 1 (ms)", "denoise 2 (ms)", "denoise 3 (ms)", "denoise 4 (ms)",
                      "commit (ms)", "5 forwards (ms)", "condition encode (ms)", "run_block (ms)", "TFLOP/s (forwards)",
                      "VAE decode (ms)"]
    rows = [dict(zip(header, cells(line))) for line in lines if line.startswith(("| 0 ", "| 1 ", "| 2 "))]
    cfg = transformer_config(PRESETS["tiny"])
    tokens = 3 * (64 // 16) ** 2  # 3 latent frames of 4 x 4 patches
    assert [int(r["keys"]) for r in rows] == [block_keys(i, 3, 9, tokens // 3) for i in range(3)] == [48, 96, 144]
    for r in rows:
        steps = [number(r[f"denoise {k} (ms)"]) for k in range(1, 5)] + [number(r["commit (ms)"])]
        forwards = number(r["5 forwards (ms)"])
        assert forwards == pytest.approx(sum(steps), abs=0.31) and forwards <= number(r["run_block (ms)"])
        flop = forward_flops(cfg, tokens, int(r["keys"])).block(5)
        assert number(r["TFLOP/s (forwards)"]) == pytest.approx(flop / forwards / 1e9, rel=0.05)  # 2 digits

    summary = {cells(line)[0]: cells(line)[1:] for line in lines
               if line.startswith("| ") and not line.startswith("| block")}
    assert summary[""] == ["eager", "reference (H200, compiled)"]
    eager = {name: row[0] for name, row in summary.items()}
    full = rows[2]  # the full-window block is the only one here: its median is itself
    assert eager["full-window block: run_block, median (ms)"] == full["run_block (ms)"]
    assert eager["full-window block: 5 forwards, median (ms)"] == full["5 forwards (ms)"]
    assert eager["full-window block: commit forward, median (ms)"] == full["commit (ms)"]
    flop = forward_flops(cfg, tokens, 144).block(5)
    assert number(eager["FLOP per full-window block (TFLOP)"]) == pytest.approx(flop / 1e12, rel=0.01)
    assert number(eager["achieved TFLOP/s (full-window run_block)"]) == pytest.approx(
        flop / number(full["run_block (ms)"]) / 1e9, rel=0.05)
    assert eager["peak allocated (GiB)"] == eager["peak reserved (GiB)"] == "n/a (CPU)"
    assert eager["fraction of 790 TFLOP/s"] == "n/a (CPU)"
    assert eager["VAE decode overlapped with the DiT"].endswith("% of its time")

    reference = {name: row[1] for name, row in summary.items()}
    assert number(reference["full-window block: run_block, median (ms)"]) == REFERENCE["block_ms"]
    assert number(reference["whole request (s)"]) == REFERENCE["request_s"]
    assert number(reference["peak allocated (GiB)"]) == REFERENCE["peak_allocated_gib"]
    assert number(reference["FLOP per full-window block (TFLOP)"]) == pytest.approx(REFERENCE_BLOCK_FLOP / 1e12, abs=0.05)
    reference_tflops = REFERENCE_BLOCK_FLOP / REFERENCE["block_ms"] / 1e9
    assert number(reference["achieved TFLOP/s (full-window run_block)"]) == pytest.approx(reference_tflops, abs=0.5)
    assert number(reference["fraction of 790 TFLOP/s"].rstrip("%")) == pytest.approx(
        100 * reference_tflops / BF16_MATMUL_TFLOPS, abs=0.5)
    assert "profile of block 2 (full window)" in text
    assert "attention kernels in the profile: aten::" in text
