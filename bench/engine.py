"""Per-block DiT latency of the engine at SP1/SP2/SP4 (and TP x SP with --tp) on CPU (gloo), side by side.

    python -m bench.engine [--sp 1 2 4] [--tp 1 2 4] [--blocks 5] [--preset tiny] [--dtype float32]

Each TP x SP grid runs as its own gloo group of tp x sp ranks (bench.common.run_cpu_group), one after
another: a warm-up block, then one timed request. The ranks share the machine's cores as a server's CPU
instances do (torch threads per rank = cores // ranks, at least 1), so SP1 gets every core. Block times are
rank 0's (the rank that also decodes, as the serving rank does). Bytes per rank: the DiT weights, one session's
caches, and per block the all-to-all bytes sent and the TP all-reduce / all-gather payload.
"""
from __future__ import annotations

import os

from backend.serving.threads import instance_cores
from bench.common import (
    TINY,
    ensure_checkpoint,
    grid_label,
    grids_of,
    run_cpu_group,
    sp_parser,
    sp_table,
    sweep_sp,
    workload_from_args,
)


def main() -> None:
    args = sp_parser(__doc__, TINY, preset="tiny").parse_args()
    w = workload_from_args(args)
    checkpoint = ensure_checkpoint(args.checkpoint, args.preset)
    cores = os.cpu_count()
    print(f"checkpoint {checkpoint} ({args.preset if args.checkpoint is None else 'given'}), {w.height}x{w.width}, "
          f"{w.num_frames} frames = {w.blocks} blocks, {w.dtype}, window {w.window_frames}, sink {w.sink_frames}")
    grids = grids_of(args)
    ranks = [tp * sp for tp, sp in grids]
    threads = ", ".join(f"{grid_label(k)} {n} x {instance_cores(n)}" for k, n in zip(grids, ranks))
    print(f"CPU, gloo, {cores} cores shared by the ranks: torch threads per rank = cores // ranks ({threads})"
          + (f"; more than {cores} ranks oversubscribe the cores" if max(ranks) > cores else ""), flush=True)
    print(sp_table(sweep_sp(grids, run_cpu_group, checkpoint, w, args.warmup_blocks)))


if __name__ == "__main__":
    main()
