"""Run Triton's perf_analyzer (gRPC streaming) against the lingbot_world model.

    python -m bench.perf_analyzer [--url HOST:PORT] [--sp 1] [--concurrency-range 1:2] [-- EXTRA_ARGS...]
    python -m bench.perf_analyzer --workload steer --sessions 1 2 4   # per-step latency table, steered

Every request is a Triton sequence: a whole trajectory is one request (--sequence-length 1), a steered
session one request per block (its steps from bench.make_perf_inputs --workload steer).

Installs the binary with `python -m backend.launch --install-perf-analyzer` (idempotent), writes
bench/perf_inputs/tiny.json if absent, starts a tiny-model server like bench/streaming.py does (unless
--url), and runs perf_analyzer with the launcher's LD_LIBRARY_PATH. Arguments after `--` go to perf_analyzer.
"""
from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from backend.launch.paths import REPO_ROOT
from backend.launch.perf_analyzer import perf_analyzer_environment
from backend.api.contract import MODEL_NAME
from bench.common import TINY, add_checkpoint_args, ensure_checkpoint
from bench.make_perf_inputs import STEER_KEYS, WORKLOADS, write_perf_inputs
from bench.streaming import sp_server


def install() -> Path:
    done = subprocess.run([sys.executable, "-m", "backend.launch", "--install-perf-analyzer"], cwd=REPO_ROOT,
                          check=True, stdout=subprocess.PIPE, text=True)
    return Path(done.stdout.strip().splitlines()[-1])


def command(binary: Path, url: str, args: argparse.Namespace, concurrency: str, csv: Path | None = None) -> list[str]:
    steps = len(STEER_KEYS) if args.workload == "steer" else 1
    cmd = [str(binary), "-m", MODEL_NAME, "-u", url, "-i", "grpc", "--streaming", "--input-data", str(args.input_data),
           "--measurement-interval", str(args.measurement_interval), "--concurrency-range", concurrency,
           "--sequence-length", str(steps), "--sequence-id-range", "1:1000000000", *args.extra]
    return cmd + (["-f", str(csv)] if csv else [])


def run(binary: Path, url: str, args: argparse.Namespace) -> int:
    env = perf_analyzer_environment(binary.parent)
    if not args.sessions:
        cmd = command(binary, url, args, args.concurrency_range)
        print(f"LD_LIBRARY_PATH={env['LD_LIBRARY_PATH']} {shlex.join(cmd)}", flush=True)
        return subprocess.run(cmd, env=env, check=False).returncode
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.sessions:  # one run per concurrency: its own CSV row
            csv = Path(tmp) / f"c{n}.csv"
            cmd = command(binary, url, args, f"{n}:{n}", csv)
            print(f"LD_LIBRARY_PATH={env['LD_LIBRARY_PATH']} {shlex.join(cmd)}", flush=True)
            done = subprocess.run(cmd, env=env, check=False, capture_output=True, text=True)
            if done.returncode != 0:
                print(done.stdout[-3000:], done.stderr[-3000:], file=sys.stderr)
                return done.returncode
            row = dict(zip(*[line.split(",") for line in csv.read_text().splitlines()[:2]]))
            rows.append((n, row))
    print("\n| sessions | requests/s | p50 ms | p95 ms | p99 ms |\n| --- | --- | --- | --- | --- |")
    for n, row in rows:
        ms = [float(row[f"p{q} latency"]) / 1000.0 for q in (50, 95, 99)]
        print(f"| {n} | {float(row['Inferences/Second']):.2f} | " + " | ".join(f"{v:.0f}" for v in ms) + " |")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--url", help="a running server's gRPC HOST:PORT; if omitted, start a tiny-model server")
    parser.add_argument("--sp", type=int, default=1, help="SP degree of the server started here")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="tiny",
                        help="tiny: whole 57-frame trajectories; steer: steered sessions of 6 blocks")
    parser.add_argument("--input-data", type=Path, help="perf_analyzer input JSON (default: the workload's, written "
                        "if absent)")
    parser.add_argument("--sessions", type=int, nargs="*", help="print a latency table at these concurrencies")
    parser.add_argument("--measurement-interval", type=int, default=5000, help="ms per measurement window")
    parser.add_argument("--concurrency-range", default="1:2", help="START:END[:STEP] concurrent streams")
    parser.add_argument("extra", nargs="*", help="after `--`: more perf_analyzer arguments")
    add_checkpoint_args(parser, "tiny")
    args = parser.parse_args()
    binary = install()
    if args.input_data is None:
        args.input_data = WORKLOADS[args.workload][1]
        if not args.input_data.is_file():
            write_perf_inputs(args.workload)
    elif not args.input_data.is_file():
        raise SystemExit(f"error: {args.input_data} not found; write it with python -m bench.make_perf_inputs")
    if args.url:
        return run(binary, args.url, args)
    with sp_server(ensure_checkpoint(args.checkpoint, args.preset), TINY, args.sp) as server:
        return run(binary, server.grpc_url, args)


if __name__ == "__main__":
    sys.exit(main())
