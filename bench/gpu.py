"""GPU benchmark of the real workload: 480x832, 81 frames, seed 42, forward camera, SP1/SP2/SP4 over NCCL.

    python -m bench.gpu [--checkpoint PATH | --preset tiny|mid] [--sp 1 2 4]

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
    RankResult,
    add_workload_args,
    cuda_device_count,
    engine_config,
    ensure_checkpoint,
    make_request,
    rollout,
    run_cuda_group,
    sp_table,
    workload_from_args,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--sp", type=int, nargs="+", default=[1, 2, 4], help="SP degrees, the first is the baseline")
    parser.add_argument("--warmup-blocks", type=int, default=1, help="blocks of a throw-away session first")
    add_workload_args(parser, GPU, preset="mid")
    args = parser.parse_args()
    gpus = cuda_device_count()  # exits first where CUDA is absent
    degrees = [sp for sp in args.sp if sp <= gpus]
    if skipped := [sp for sp in args.sp if sp > gpus]:
        print(f"skipping SP{skipped}: {gpus} GPU(s) visible, NCCL needs one GPU per rank")
    if not degrees:
        raise SystemExit("error: no SP degree fits the visible GPUs")
    w = workload_from_args(args)
    checkpoint = ensure_checkpoint(args.checkpoint, args.preset)
    request = make_request(w)
    flash = importlib.util.find_spec("flash_attn") is not None
    print(f"checkpoint {checkpoint}, {w.height}x{w.width}, {w.num_frames} frames = {w.blocks} blocks, {w.dtype}, "
          f"window {w.window_frames}, text_len {w.text_len}; {gpus} x {torch.cuda.get_device_name(0)}, "
          f"flash-attn {'installed' if flash else 'not installed'}", flush=True)
    results: dict[int, list[RankResult]] = {}
    for sp in degrees:
        results[sp] = run_cuda_group(sp, rollout, (engine_config(checkpoint, w, sp, "cuda"), request, args.warmup_blocks))
        print(f"SP{sp} done: {results[sp][0].request_s:.2f} s, attention {results[sp][0].attention}", flush=True)
    print()
    print(sp_table(results))


if __name__ == "__main__":
    main()
