"""Command line: render the model repository and run a real `tritonserver` on the lingbot_world model.

    python -m backend.launch --sp 2 --kind cpu --param KEY=VALUE --wait
    python -m backend.launch --render-only --kind gpu --sp 4 --param checkpoint=...
    mpirun -np 2 --hostfile hosts python -m backend.launch --mpi --sp 4 --param checkpoint=... --wait
    python -m backend.launch --install-perf-analyzer

The pieces live beside it: `wheel` (server and Python backend from the nvidia-pytriton wheel),
`model_repository` (config.pbtxt rendering), `server` (the server process), `mpi` (`--mpi`: this host's
server among all hosts' servers), `perf_analyzer`.
"""
from __future__ import annotations

import argparse
import dataclasses
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from ..api.contract import MODEL_NAME
from ..api.settings import to_parameters
from ..serving.config import split_parameters
from .model_repository import DEFAULT_CHECKPOINT, write_model_repository
from .mpi import host_parameters
from .paths import BUILD_DIR, DEFAULT_BACKENDS_DIR, DEFAULT_PERF_ANALYZER_DIR, DEFAULT_REPOSITORY_DIR
from .perf_analyzer import install_perf_analyzer
from .wheel import prepare_backends
from .server import TritonServer


def gpu_count() -> int:
    """GPUs that `nvidia-smi -L` lists (0 without the tool or a driver)."""
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], check=False, capture_output=True, text=True, timeout=30)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in listing.stdout.splitlines()) if listing.returncode == 0 else 0


def resolve_placement(kind: str, instances: int) -> tuple[str, list[int] | None]:
    """(KIND_*, device ids) for a `--kind` of cpu, gpu or auto."""
    gpus = gpu_count() if kind in ("gpu", "auto") else 0
    if kind == "cpu" or (kind == "auto" and gpus == 0):
        return "KIND_CPU", None
    if gpus < instances:
        raise ValueError(f"--kind {kind} --sp {instances} needs {instances} GPUs; nvidia-smi -L lists {gpus}")
    return "KIND_GPU", list(range(instances))


def parse_param(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m backend.launch", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sp",
        type=int,
        default=1,
        help="model instances of this server (one per GPU with KIND_GPU); the SP degree is this x host_count",
    )
    parser.add_argument(
        "--mpi",
        action="store_true",
        help="under mpirun: one server per rank, all in one group (host_rank, host_count and rendezvous_host "
        "from MPI)",
    )
    parser.add_argument(
        "--kind",
        choices=("cpu", "gpu", "auto"),
        default="auto",
        help="auto (default): gpu if nvidia-smi lists GPUs, else cpu",
    )
    parser.add_argument(
        "--param",
        type=parse_param,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set a config.pbtxt parameter (repeatable)",
    )
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--repository-out", type=Path, default=DEFAULT_REPOSITORY_DIR)
    parser.add_argument("--backends-out", type=Path, default=DEFAULT_BACKENDS_DIR)
    parser.add_argument("--log-file", type=Path, default=BUILD_DIR / "tritonserver.log")
    parser.add_argument("--log-verbose", type=int, default=0)
    parser.add_argument("--wait", action="store_true", help="block until the model is ready, then keep serving")
    parser.add_argument("--wait-timeout", type=float, default=600.0, help="seconds --wait allows (default 600)")
    parser.add_argument(
        "--render-only",
        action="store_true",
        help="write the model repository, print its path and exit (for a server started elsewhere, e.g. NGC)",
    )
    parser.add_argument(
        "--install-perf-analyzer",
        action="store_true",
        help=f"install perf_analyzer into {DEFAULT_PERF_ANALYZER_DIR}, print its path and exit",
    )
    return parser


def render(args: argparse.Namespace) -> tuple[Path, str]:
    kind, device_ids = resolve_placement(args.kind, args.sp)
    parameters = dict(args.param)
    if args.mpi:
        shared = {"sp": str(args.sp), "kind": kind, **parameters}
        ports_and_paths = {
            "grpc_port": str(args.grpc_port),
            "http_port": str(args.http_port),
            "metrics_port": str(args.metrics_port),
            "repository_out": str(args.repository_out.resolve()),
            "log_file": str(args.log_file.resolve()),
        }
        parameters.update(host_parameters(shared, ports_and_paths))
    engine, serving = split_parameters({"checkpoint": DEFAULT_CHECKPOINT} | parameters)  # names a bad key or value
    engine = dataclasses.replace(engine, sp_degree=args.sp * serving.host_count)  # one SP rank per instance
    parameters = to_parameters(engine) | to_parameters(serving)
    repository = write_model_repository(
        args.repository_out,
        instances=args.sp,
        kind=kind,
        device_ids=device_ids,
        parameters=parameters,
    )
    return repository, kind


def serve(args: argparse.Namespace) -> int:
    repository, kind = render(args)
    backends = prepare_backends(args.backends_out)
    server = TritonServer(
        repository,
        backends_dir=backends,
        grpc_port=args.grpc_port,
        http_port=args.http_port,
        metrics_port=args.metrics_port,
        log_verbose=args.log_verbose,
        log_path=args.log_file,
        die_with_parent=True,  # a launcher killed outright (mpirun's teardown) takes its server along
    )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind through `with` so the group is stopped
    with server:
        print(f"tritonserver pid {server.pid} grpc {server.grpc_url} log {server.log_path}", flush=True)
        try:
            if args.wait:
                server.wait_ready(MODEL_NAME, args.wait_timeout)
                print(f"model {MODEL_NAME} ready ({args.sp} x {kind}) on {server.grpc_url}", flush=True)
            rc = server.wait()
        except KeyboardInterrupt:
            return 130
    if rc == 0:
        return 0
    print(f"tritonserver exited with code {rc}; from its log:\n{server.log_excerpt()}", file=sys.stderr)
    return rc if rc > 0 else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.render_only:
            print(render(args)[0])
            return 0
        if not args.install_perf_analyzer:
            return serve(args)
        path = install_perf_analyzer()
        print(f"run it with LD_LIBRARY_PATH={path.parent}", file=sys.stderr)
        print(path)
        return 0
    except (FileNotFoundError, ValueError, RuntimeError, TimeoutError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
