"""What an idle SP group costs: CPU per instance while no request runs, and time to first block after it.

    python -m bench.idle [--sp 2] [--seconds 60] [--repeats 3]

Starts a real tritonserver (KIND_CPU, `sp` instances, default serving settings), streams one request to warm
it, then reads each stub's CPU time (/proc/PID/stat utime + stime) over `--seconds` of idleness; then sends
`--repeats` single requests, each after a short idle pause, and reports their time to first block.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from bench.common import TINY, add_workload_args, ensure_checkpoint, format_table, make_request, workload_from_args
from bench.streaming import sp_server, stream_request
from client.stream import run_sessions


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--sp", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=60.0, help="idle window")
    parser.add_argument("--repeats", type=int, default=3, help="requests timed for TTFB after idling")
    add_workload_args(parser, TINY, preset="tiny")
    args = parser.parse_args()
    w = workload_from_args(args)
    checkpoint = ensure_checkpoint(args.checkpoint, args.preset)
    request = make_request(w, decode=True)
    with sp_server(checkpoint, w, args.sp) as server:
        run_sessions(server.grpc_url, [stream_request(request, "warm-up")], timeout=600, keep_data=False)
        pids = list(server.stub_pids().values())
        before, start = [cpu_seconds(p) for p in pids], time.monotonic()
        time.sleep(args.seconds)
        elapsed = time.monotonic() - start
        idle = [(cpu_seconds(p) - b) / elapsed for p, b in zip(pids, before)]
        ttfb = []
        for i in range(args.repeats):
            time.sleep(2.0)
            (result,) = run_sessions(server.grpc_url, [stream_request(request, f"after-idle-{i}")], timeout=600,
                                     keep_data=False)
            ttfb.append(1000.0 * (result.time_to_first_block_s or float("nan")))
    rows = [[f"rank {r}", f"{100 * u:.2f} %"] for r, u in enumerate(idle)]
    rows.append([f"time to first block after idling, median of {args.repeats} (ms)", f"{statistics.median(ttfb):.1f}"])
    print(format_table([f"SP{args.sp}, idle {elapsed:.0f} s: CPU of a core per instance", ""], rows))


if __name__ == "__main__":
    main()
