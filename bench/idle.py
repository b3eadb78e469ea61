"""What an idle SP group costs: CPU per instance with no session, and while a steered session waits for its
next step (a paused player); then the time to first block after idling.

    python -m bench.idle [--sp 2] [--seconds 60] [--steered-seconds 40] [--repeats 3]

Starts a real tritonserver (KIND_CPU, `sp` instances, default serving settings), streams one request to warm
it, then reads each stub's CPU time (/proc/PID/stat utime + stime) over `--seconds` with no session; then opens
a steered session, takes its first block and reads the same over `--steered-seconds` while the session waits for
its next step (keep it under session_idle_timeout_s, 60 s by default), and ends it; then sends `--repeats`
single requests, each after a short idle pause, and reports their time to first block.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

from backend.api.request import Controls
from backend.launch.procfs import cpu_seconds
from bench.common import TINY, add_workload_args, ensure_checkpoint, format_table, make_request, workload_from_args
from bench.streaming import sp_server, stream_request
from client.steer import SteeredSession
from client.stream import run_sessions


def cpu_share(pids: list[int], seconds: float) -> list[float]:
    """Each process's CPU over the next `seconds`, as a fraction of one core."""
    before, start = [cpu_seconds(p) for p in pids], time.monotonic()
    time.sleep(seconds)
    elapsed = time.monotonic() - start
    return [(cpu_seconds(p) - b) / elapsed for p, b in zip(pids, before)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--sp", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=60.0, help="idle window with no session")
    parser.add_argument("--steered-seconds", type=float, default=40.0,
                        help="window while a steered session waits for its next step")
    parser.add_argument("--repeats", type=int, default=3, help="requests timed for TTFB after idling")
    add_workload_args(parser, TINY, preset="tiny")
    args = parser.parse_args()
    w = workload_from_args(args)
    checkpoint = ensure_checkpoint(args.checkpoint, args.preset)
    request = make_request(w, decode=True)
    steered = dataclasses.replace(make_request(w, decode=False), num_frames=None, poses=None, keys="w")
    with sp_server(checkpoint, w, args.sp) as server:
        run_sessions(server.grpc_url, [stream_request(request, "warm-up")], timeout=600, keep_data=False)
        pids = list(server.stub_pids().values())
        idle = cpu_share(pids, args.seconds)
        with SteeredSession(server.grpc_url) as session:
            session.start(steered)
            session.next_block(600)
            waiting = cpu_share(pids, args.steered_seconds)
            session.step(Controls(keys="w"), end=True)
            session.next_block(600)
        ttfb = []
        for i in range(args.repeats):
            time.sleep(2.0)
            (result,) = run_sessions(server.grpc_url, [stream_request(request, f"after-idle-{i}")], timeout=600,
                                     keep_data=False)
            ttfb.append(1000.0 * (result.time_to_first_block_s or float("nan")))
    rows = [[f"rank {r}", f"{100 * a:.2f} %", f"{100 * b:.2f} %", f"{100 * (b - a):+.2f}"]
            for r, (a, b) in enumerate(zip(idle, waiting))]
    print(format_table([f"SP{args.sp}: CPU of a core per instance", f"no session, {args.seconds:.0f} s",
                        f"steered session waiting for its step, {args.steered_seconds:.0f} s", "points"], rows))
    print(f"time to first block after idling, median of {args.repeats}: {statistics.median(ttfb):.1f} ms")


if __name__ == "__main__":
    main()
