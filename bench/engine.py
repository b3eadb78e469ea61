"""Per-block DiT latency of the engine at SP1/SP2/SP4 on CPU (gloo), side by side in one run.

    python -m bench.engine [--sp 1 2 4] [--blocks 5] [--preset tiny] [--dtype float32]

Each SP degree runs as its own gloo group (bench.common.run_cpu_group), one after another: a warm-up block,
then one timed request. The ranks share the machine's cores as a server's CPU instances do (torch threads
per rank = cores // sp, at least 1), so SP1 gets every core. Block times are rank 0's (the rank that also
decodes, as the serving rank does).
"""
from __future__ import annotations

import os

from backend.serving.threads import instance_cores
from bench.common import TINY, ensure_checkpoint, run_cpu_group, sp_parser, sp_table, sweep_sp, workload_from_args


def main() -> None:
    args = sp_parser(__doc__, TINY, preset="tiny").parse_args()
    w = workload_from_args(args)
    checkpoint = ensure_checkpoint(args.checkpoint, args.preset)
    cores = os.cpu_count()
    print(f"checkpoint {checkpoint} ({args.preset if args.checkpoint is None else 'given'}), {w.height}x{w.width}, "
          f"{w.num_frames} frames = {w.blocks} blocks, {w.dtype}, window {w.window_frames}, sink {w.sink_frames}")
    threads = ", ".join(f"SP{sp} {sp} x {instance_cores(sp)}" for sp in args.sp)
    print(f"CPU, gloo, {cores} cores shared by the ranks: torch threads per rank = cores // sp ({threads})"
          + (f"; SP ranks > {cores} oversubscribe the cores" if max(args.sp) > cores else ""), flush=True)
    print(sp_table(sweep_sp(args.sp, run_cpu_group, checkpoint, w, args.warmup_blocks)))


if __name__ == "__main__":
    main()
