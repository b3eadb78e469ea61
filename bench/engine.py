"""Per-block DiT latency of the engine at SP1/SP2/SP4 on CPU (gloo), side by side in one run.

    python -m bench.engine [--sp 1 2 4] [--blocks 5] [--preset tiny] [--dtype float32]

Each SP degree runs as its own gloo group (backend.local_group.run_group), one torch thread per rank,
one after another: a warm-up block, then one timed request. Block times are rank 0's (the rank that
also decodes, as the serving rank does).
"""
from __future__ import annotations

import os

from backend.parallel.local import run_group
from bench.common import TINY, ensure_checkpoint, sp_parser, sp_table, sweep_sp, workload_from_args


def main() -> None:
    args = sp_parser(__doc__, TINY, preset="tiny").parse_args()
    w = workload_from_args(args)
    checkpoint = ensure_checkpoint(args.checkpoint, args.preset)
    cores = os.cpu_count()
    print(f"checkpoint {checkpoint} ({args.preset if args.checkpoint is None else 'given'}), {w.height}x{w.width}, "
          f"{w.num_frames} frames = {w.blocks} blocks, {w.dtype}, window {w.window_frames}, sink {w.sink_frames}")
    print(f"CPU, gloo: torch threads = 1 per rank so SP ranks don't oversubscribe each other "
          f"({cores} cores: SP ranks > {cores} share cores)", flush=True)
    print(sp_table(sweep_sp(args.sp, run_group, checkpoint, w, args.warmup_blocks)))


if __name__ == "__main__":
    main()
