"""Per-block DiT latency of the engine at SP1/SP2/SP4 on CPU (gloo), side by side in one run.

    python -m bench.engine [--sp 1 2 4] [--blocks 5] [--preset tiny] [--dtype float32]

Each SP degree runs as its own gloo group (backend.local_group.run_group), one torch thread per rank,
one after another: a warm-up block, then one timed request. Block times are rank 0's (the rank that
also decodes, as the serving rank does).
"""
from __future__ import annotations

import argparse
import os

from backend.local_group import run_group
from bench.common import (
    TINY,
    RankResult,
    add_workload_args,
    engine_config,
    ensure_checkpoint,
    make_request,
    rollout,
    sp_table,
    workload_from_args,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--sp", type=int, nargs="+", default=[1, 2, 4], help="SP degrees, the first is the baseline")
    parser.add_argument("--warmup-blocks", type=int, default=1, help="blocks of a throw-away session first")
    add_workload_args(parser, TINY, preset="tiny")
    args = parser.parse_args()
    w = workload_from_args(args)
    checkpoint = ensure_checkpoint(args.checkpoint, args.preset)
    request = make_request(w)
    cores = os.cpu_count()
    print(f"checkpoint {checkpoint} ({args.preset if args.checkpoint is None else 'given'}), {w.height}x{w.width}, "
          f"{w.num_frames} frames = {w.blocks} blocks, {w.dtype}, window {w.window_frames}, sink {w.sink_frames}")
    print(f"CPU, gloo: torch threads = 1 per rank so SP ranks don't oversubscribe each other "
          f"({cores} cores: SP ranks > {cores} share cores)", flush=True)
    results: dict[int, list[RankResult]] = {}
    for sp in args.sp:
        results[sp] = run_group(sp, rollout, (engine_config(checkpoint, w, sp), request, args.warmup_blocks))
        print(f"SP{sp} done: {results[sp][0].request_s:.2f} s, attention {results[sp][0].attention}", flush=True)
    print()
    print(sp_table(results))


if __name__ == "__main__":
    main()
