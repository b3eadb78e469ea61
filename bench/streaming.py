"""Streaming load generator over Triton gRPC: SP1/SP2(/SP4) servers side by side, plus Triton vs direct engine.

    python -m bench.streaming [--sp 1 2] [--concurrency 1 2 4] [--rounds 1] [--url HOST:PORT]

For each SP degree it starts a real tritonserver (KIND_CPU, one instance per rank, the engine parameters of
the direct run), warms it with one stream per rank, then sends 1..N sessions at once per concurrency level
(client.stream.run_sessions). Peak RSS per rank is VmHWM of the server's backend stub processes, reset
(/proc/PID/clear_refs) before each level. Before the servers it times the same request through an in-process
WorldModelEngine.generate, to compare with one stream through the SP1 server.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from backend.engine.rollout import WorldModelEngine
from backend.launch.model_repository import write_model_repository
from backend.launch.wheel import prepare_backends
from backend.launch.server import TritonServer
from backend.api.contract import MODEL_NAME
from backend.api.request import SessionRequest
from bench.common import (
    BUILD_DIR,
    TINY,
    Workload,
    add_workload_args,
    engine_config,
    ensure_checkpoint,
    format_table,
    make_request,
    percentile,
    server_parameters,
    workload_from_args,
)
from client.stream import SessionResult, StreamRequest, request_inputs, run_sessions


@dataclass
class LevelStats:
    results: list[SessionResult]
    wall_s: float  # summed over rounds: first send .. last response
    frames_per_request: int
    rss_mib: list[float] | None  # VmHWM per rank during the level

    @property
    def ok(self) -> list[SessionResult]:
        return [r for r in self.results if r.error is None and r.blocks]

    @property
    def errors(self) -> list[str]:
        return [f"{r.request_id}: {r.error}" for r in self.results if r.error is not None]

    def metrics(self) -> dict[str, float]:
        ok = self.ok
        ttfb = [1000.0 * (r.time_to_first_block_s or 0.0) for r in ok]
        gaps = [1000.0 * g for r in ok for g in r.inter_block_s]
        whole = [r.blocks[-1].arrival_s - (r.sent_s or 0.0) for r in ok]
        timing = [b.timing_ms for r in ok for b in r.blocks if len(b.timing_ms) == 3]
        return {
            "TTFB p50 (ms)": percentile(ttfb, 50),
            "inter-block p50 (ms)": percentile(gaps, 50),
            "inter-block p95 (ms)": percentile(gaps, 95),
            "inter-block p99 (ms)": percentile(gaps, 99),
            "request p50 (s)": percentile(whole, 50),
            "request p95 (s)": percentile(whole, 95),
            "blocks/s": sum(len(r.blocks) for r in ok) / self.wall_s,
            "frames/s": len(ok) * self.frames_per_request / self.wall_s,
            "server DiT per block p50 (ms)": percentile([t[0] for t in timing], 50),
            "server VAE decode per block p50 (ms)": percentile([t[1] for t in timing], 50),
        }


# ---------------------------------------------------------------- the server's stub processes


def reset_peak_rss(pids: list[int]) -> bool:
    """Reset VmHWM to the current RSS (Linux clear_refs 5); False if not permitted."""
    try:
        for pid in pids:
            Path(f"/proc/{pid}/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss_mib(pids: list[int]) -> list[float] | None:
    try:
        status = [Path(f"/proc/{pid}/status").read_text() for pid in pids]
    except OSError:
        return None
    return [next(int(line.split()[1]) for line in s.splitlines() if line.startswith("VmHWM:")) / 1024 for s in status]


@contextlib.contextmanager
def sp_server(checkpoint: Path, w: Workload, sp: int) -> Iterator[TritonServer]:
    out = BUILD_DIR / "bench"
    repo = write_model_repository(out / f"repo_sp{sp}", instances=sp, kind="KIND_CPU",
                                  parameters=server_parameters(engine_config(checkpoint, w, sp)))
    with TritonServer(repo, backends_dir=prepare_backends(), log_path=out / f"tritonserver_sp{sp}.log") as server:
        server.wait_ready(MODEL_NAME, timeout=300)
        yield server


# ---------------------------------------------------------------- load


def stream_request(request: SessionRequest, request_id: str) -> StreamRequest:
    return StreamRequest(request_inputs(request), request_id, {"decode": request.decode, "return_latents": False})


def run_level(url: str, request: SessionRequest, sessions: int, rounds: int, timeout: float,
              pids: list[int]) -> LevelStats:
    results: list[SessionResult] = []
    wall = 0.0
    tracked = bool(pids) and reset_peak_rss(pids)
    for r in range(rounds):
        batch = run_sessions(url, [stream_request(request, f"c{sessions}-r{r}-{i}") for i in range(sessions)],
                             timeout=timeout, keep_data=False)
        arrivals = [b.arrival_s for s in batch for b in s.blocks]
        sent = [s.sent_s for s in batch if s.sent_s is not None]
        wall += (max(arrivals) - min(sent)) if arrivals and sent else 0.0
        results += batch
    return LevelStats(results, wall or float("nan"), request.num_frames, peak_rss_mib(pids) if tracked else None)


def direct_engine_s(checkpoint: Path, w: Workload, request: SessionRequest, repeats: int) -> list[float]:
    """In-process WorldModelEngine.generate: one warm-up, then `repeats` timed runs."""
    engine = WorldModelEngine.load(engine_config(checkpoint, w, 1))
    engine.generate(request)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        engine.generate(request)
        times.append(time.perf_counter() - start)
    return times


def triton_single_s(url: str, request: SessionRequest, repeats: int, timeout: float) -> list[float]:
    times = []
    for i in range(repeats):
        (result,) = run_sessions(url, [stream_request(request, f"single-{i}")], timeout=timeout, keep_data=False)
        if result.error is not None or not result.blocks:
            raise SystemExit(f"error: single stream failed: {result.error}")
        times.append(result.blocks[-1].arrival_s - (result.sent_s or 0.0))
    return times


# ---------------------------------------------------------------- report


def level_table(stats: dict[str, dict[int, LevelStats]]) -> str:
    """One row per (sessions, metric); a column per server, then its ratio to the first server."""
    names = list(stats)
    base = names[0]
    header = ["sessions", "metric"] + [c for n in names for c in ([n] if n == base else [n, f"{n}/{base}"])]
    rows = []

    def add(level: int, label: str, cells: dict[str, str], values: dict[str, float]) -> None:
        row = [str(level), label]
        for n in names:
            row.append(cells[n])
            if n != base:
                ok = values[base] > 0 and values[n] == values[n]  # NaN when a server had no data
                row.append(f"{values[n] / values[base]:.2f}x" if ok else "")
        rows.append(row)

    for level in stats[base]:
        metrics = {n: stats[n][level].metrics() for n in names}
        for key in metrics[base]:
            values = {n: metrics[n][key] for n in names}
            add(level, key, {n: f"{v:.1f}" if "ms" in key else f"{v:.2f}" for n, v in values.items()}, values)
        rss = {n: stats[n][level].rss_mib or [] for n in names}
        add(level, "peak RSS per rank (MiB)", {n: "/".join(f"{m:.0f}" for m in v) or "n/a" for n, v in rss.items()},
            {n: max(v, default=float("nan")) for n, v in rss.items()})
        failed = {n: float(len(stats[n][level].errors)) for n in names}
        if any(failed.values()):
            add(level, "failed sessions", {n: f"{v:.0f}" for n, v in failed.items()}, {n: 0.0 for n in names})
    return format_table(header, rows, left=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--sp", type=int, nargs="+", default=[1, 2], help="SP degrees, one server each, in order")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4], help="sessions sent at once")
    parser.add_argument("--rounds", type=int, default=3, help="batches of sessions per concurrency level")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of the Triton vs direct comparison")
    parser.add_argument("--no-decode", action="store_true", help="skip VAE decoding (latent blocks only)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per stream")
    parser.add_argument("--url", help="use a running server at HOST:PORT instead (no RSS, no direct comparison)")
    add_workload_args(parser, TINY, preset="tiny")
    args = parser.parse_args()
    w = workload_from_args(args)
    checkpoint = ensure_checkpoint(args.checkpoint, args.preset)
    request = make_request(w, decode=not args.no_decode)
    print(f"{w.height}x{w.width}, {w.num_frames} frames = {w.blocks} blocks, {w.dtype}, decode {request.decode}, "
          f"{'server ' + args.url if args.url else f'checkpoint {checkpoint}'}; {os.cpu_count()} CPU cores", flush=True)
    stats: dict[str, dict[int, LevelStats]] = {}
    direct: list[float] = []
    single: list[float] = []
    threads = os.cpu_count() or 1  # what the SP1 server instance sets: cpu_count // sp
    if args.url:
        triton_single_s(args.url, request, 1, args.timeout)  # warm-up
        stats["server"] = {c: run_level(args.url, request, c, args.rounds, args.timeout, []) for c in args.concurrency}
    elif 1 in args.sp:
        torch.set_num_threads(threads)
        direct = direct_engine_s(checkpoint, w, request, args.repeats)
    for sp in [] if args.url else args.sp:
        with sp_server(checkpoint, w, sp) as server:
            pids = list(server.stub_pids().values())
            if len(pids) != sp:
                print(f"SP{sp}: found {len(pids)} stub processes under pid {server.pid}; peak RSS unavailable")
                pids = []
            triton_single_s(server.grpc_url, request, sp, args.timeout)  # warm-up: Triton spreads them over ranks
            if sp == 1:
                single = triton_single_s(server.grpc_url, request, args.repeats, args.timeout)
            stats[f"SP{sp}"] = {c: run_level(server.grpc_url, request, c, args.rounds, args.timeout, pids)
                                for c in args.concurrency}
        print(f"SP{sp} done", flush=True)
    print()
    print(level_table(stats))
    for name, levels in stats.items():
        for level in levels.values():
            for error in level.errors:
                print(f"{name} error: {error}")
    if any(level.rss_mib is None for levels in stats.values() for level in levels.values()):
        print("peak RSS n/a: --url (no server pid), stub processes not found or /proc/PID/clear_refs not writable")
    if direct and single:
        rows = [[f"in-process WorldModelEngine.generate ({threads} torch threads)", f"{statistics.median(direct):.3f}"],
                ["one stream through the SP1 server (send .. final block)", f"{statistics.median(single):.3f}"],
                ["Triton / direct", f"{statistics.median(single) / statistics.median(direct):.2f}x"]]
        print()
        print(format_table([f"same request, median of {args.repeats}", "s"], rows))


if __name__ == "__main__":
    main()
