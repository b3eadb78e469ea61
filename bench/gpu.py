"""GPU benchmark of the real workload: 480x832, 81 frames, seed 42, forward camera, SP1/SP2/SP4 over NCCL.

    python -m bench.gpu [--checkpoint PATH | --preset tiny|mid] [--sp 1 2 4] [--tp 1 2]
    python -m bench.gpu --random-weights [--dry-run] [--profile] ...   # bench/gpu_random_weights.py


One spawned process per GPU (rank r on cuda:r), bf16, attention 'auto' (flash-attn when installed, else
SDPA). Prints the table of bench/engine.py plus peak CUDA memory per rank. SP degrees needing more GPUs
than are visible are skipped. Without a checkpoint it writes a random --preset one (default mid: the
real 40-head geometry at reduced depth and width) to build/checkpoints/PRESET.
"""
from __future__ import annotations

import argparse
import importlib.util

import torch

from bench.common import (
    GPU,
    cuda_device_count,
    ensure_checkpoint,
    grid_label,
    grids_of,
    run_cuda_group,
    sp_parser,
    sp_table,
    sweep_sp,
    workload_from_args,
)


def main(argv: list[str] | None = None) -> None:
    mode = argparse.ArgumentParser(add_help=False)
    mode.add_argument("--random-weights", action="store_true")
    known, rest = mode.parse_known_args(argv)
    if known.random_weights:  # the 14B geometry at SP1 with weights made in memory: its own options
        from bench import gpu_random_weights

        return gpu_random_weights.main(rest)
    args = sp_parser(__doc__, GPU, preset="mid").parse_args(rest)
    gpus = cuda_device_count()  # exits first where CUDA is absent
    grids = grids_of(args, most_ranks=gpus)
    if skipped := [grid_label(k) for k in grids_of(args) if k not in grids]:
        print(f"skipping {', '.join(skipped)}: {gpus} GPU(s) visible, NCCL needs one GPU per rank")
    if not grids:
        raise SystemExit("error: no grid fits the visible GPUs")
    w = workload_from_args(args)
    checkpoint = ensure_checkpoint(args.checkpoint, args.preset)
    flash = importlib.util.find_spec("flash_attn") is not None
    print(f"checkpoint {checkpoint}, {w.height}x{w.width}, {w.num_frames} frames = {w.blocks} blocks, {w.dtype}, "
          f"window {w.window_frames}; {gpus} x {torch.cuda.get_device_name(0)}, "
          f"flash-attn {'installed' if flash else 'not installed'}", flush=True)
    print(sp_table(sweep_sp(grids, run_cuda_group, checkpoint, w, args.warmup_blocks, "cuda")))


if __name__ == "__main__":
    main()
