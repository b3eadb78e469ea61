"""Run Triton's perf_analyzer (gRPC streaming) against the lingbot_world model.

    python -m bench.perf_analyzer [--url HOST:PORT] [--sp 1] [--concurrency-range 1:2] [-- EXTRA_ARGS...]

Installs the binary with `python -m backend.launch --install-perf-analyzer` (idempotent), writes
bench/perf_inputs/tiny.json if absent, starts a tiny-model server like bench/streaming.py does (unless
--url), and runs perf_analyzer with the launcher's LD_LIBRARY_PATH. Arguments after `--` go to perf_analyzer.
"""
from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path

from backend.launch.paths import REPO_ROOT
from backend.launch.perf_analyzer import perf_analyzer_environment
from backend.api.contract import MODEL_NAME
from bench.common import TINY, add_checkpoint_args, ensure_checkpoint
from bench.make_perf_inputs import WORKLOADS, write_perf_inputs
from bench.streaming import sp_server


def install() -> Path:
    done = subprocess.run([sys.executable, "-m", "backend.launch", "--install-perf-analyzer"], cwd=REPO_ROOT,
                          check=True, stdout=subprocess.PIPE, text=True)
    return Path(done.stdout.strip().splitlines()[-1])


def run(binary: Path, url: str, args: argparse.Namespace) -> int:
    cmd = [str(binary), "-m", MODEL_NAME, "-u", url, "-i", "grpc", "--streaming", "--input-data", str(args.input_data),
           "--measurement-interval", str(args.measurement_interval), "--concurrency-range", args.concurrency_range,
           *args.extra]
    env = perf_analyzer_environment(binary.parent)
    print(f"LD_LIBRARY_PATH={env['LD_LIBRARY_PATH']} {shlex.join(cmd)}", flush=True)
    return subprocess.run(cmd, env=env, check=False).returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--url", help="a running server's gRPC HOST:PORT; if omitted, start a tiny-model server")
    parser.add_argument("--sp", type=int, default=1, help="SP degree of the server started here")
    parser.add_argument("--input-data", type=Path, default=WORKLOADS["tiny"][1],
                        help="perf_analyzer input JSON (the default one is written if absent)")
    parser.add_argument("--measurement-interval", type=int, default=5000, help="ms per measurement window")
    parser.add_argument("--concurrency-range", default="1:2", help="START:END[:STEP] concurrent streams")
    parser.add_argument("extra", nargs="*", help="after `--`: more perf_analyzer arguments")
    add_checkpoint_args(parser, "tiny")
    args = parser.parse_args()
    binary = install()
    if not args.input_data.is_file():
        if args.input_data != WORKLOADS["tiny"][1]:
            raise SystemExit(f"error: {args.input_data} not found; write it with python -m bench.make_perf_inputs")
        write_perf_inputs("tiny")
    if args.url:
        return run(binary, args.url, args)
    with sp_server(ensure_checkpoint(args.checkpoint, args.preset), TINY, args.sp) as server:
        return run(binary, server.grpc_url, args)


if __name__ == "__main__":
    sys.exit(main())
