"""Streaming load generator over Triton gRPC: SP1/SP2(/SP4) servers side by side, plus Triton vs direct engine.

    python -m bench.streaming [--sp 1 2] [--concurrency 1 2 4] [--rounds 1] [--url HOST:PORT]

It starts a real tritonserver per SP degree (KIND_CPU, one instance per rank, the engine parameters of the
direct run), all up at once, and warms each with one stream per rank. Then the same request, decode off and
on, goes in turn to the direct engine (WorldModelEngine in its own process with every core's torch threads and
the stubs' thread settings) and to each server, `--repeats` times: DiT and decode per block, request time, and
the control plane's CPU per block from each rank's metrics. Last, each server in turn gets 1..N sessions at
once per concurrency level (client.stream.run_sessions). Peak RSS per rank is VmHWM of the server's backend
stub processes, reset (/proc/PID/clear_refs) before each level.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import multiprocessing as mp
import os
import statistics
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from backend.engine.settings import EngineSettings
from backend.engine.rollout import WorldModelEngine
from backend.launch.model_repository import write_model_repository
from backend.launch.procfs import status_kib
from backend.launch.wheel import prepare_backends
from backend.launch.server import TritonServer
from backend.api.contract import MODEL_NAME
from backend.api.request import SessionRequest
from backend.serving.threads import CoreSplit, instance_cores
from bench.common import (
    BUILD_DIR,
    TINY,
    Workload,
    add_workload_args,
    engine_settings,
    ensure_checkpoint,
    format_table,
    make_request,
    percentile,
    server_parameters,
    use_stub_thread_environment,
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
        return [status_kib(pid, "VmHWM") / 1024 for pid in pids]
    except OSError:
        return None


@contextlib.contextmanager
def sp_server(checkpoint: Path, w: Workload, sp: int) -> Iterator[TritonServer]:
    out = BUILD_DIR / "bench"
    repo = write_model_repository(out / f"repo_sp{sp}", instances=sp, kind="KIND_CPU",
                                  parameters=server_parameters(engine_settings(checkpoint, w, sp)))
    with TritonServer(repo, backends_dir=prepare_backends(), log_path=out / f"tritonserver_sp{sp}.log") as server:
        server.wait_ready(MODEL_NAME, timeout=300)
        yield server


def stub_pids(server: TritonServer, sp: int) -> list[int]:
    pids = list(server.stub_pids().values())
    if len(pids) != sp:
        print(f"SP{sp}: found {len(pids)} stub processes under pid {server.pid}; peak RSS unavailable")
        return []
    return pids


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


# ---------------------------------------------------------------- one request: direct engine vs servers


@dataclass
class Timings:
    """One source's runs of the same request: DiT and decode ms of every block, seconds per request."""

    dit_ms: list[float] = field(default_factory=list)
    decode_ms: list[float] = field(default_factory=list)
    request_s: list[float] = field(default_factory=list)
    loop_cpu_s: list[float] | None = None  # per rank: the group loop's CPU outside run_block (servers only)
    blocks_run: list[float] | None = None  # per rank: session blocks run, over the same requests

    def add(self, other: Timings) -> None:
        self.dit_ms += other.dit_ms
        self.decode_ms += other.decode_ms
        self.request_s += other.request_s


_engine: WorldModelEngine | None = None  # the direct engine process's own


def _load_direct(settings: EngineSettings, threads: int, request: SessionRequest) -> None:
    global _engine
    torch.set_num_threads(threads)
    _engine = WorldModelEngine.load(settings)
    _engine.generate(request)  # warm-up


def _direct_request(request: SessionRequest) -> Timings:
    """WorldModelEngine's own rollout (generate's loop): run_block, then decode, block after block."""
    assert _engine is not None
    t = Timings()
    start = time.perf_counter()
    with _engine.session(request) as session:
        last = time.perf_counter()
        for out, _ in _engine.blocks(session, decode=request.decode):
            now = time.perf_counter()
            t.dit_ms.append(out.dit_ms)
            t.decode_ms.append((now - last) * 1000.0 - out.dit_ms)  # the rest of the iteration: the decode
            last = now
    t.request_s.append(time.perf_counter() - start)
    return t


@contextlib.contextmanager
def direct_engine(checkpoint: Path, w: Workload, request: SessionRequest) -> Iterator[mp.pool.Pool]:
    """The in-process engine as a user runs it, in a process of its own: SP1 with every core's torch threads and
    the server stubs' thread settings (numpy here was loaded without them)."""
    use_stub_thread_environment()
    with mp.get_context("spawn").Pool(1, _load_direct, (engine_settings(checkpoint, w, 1), instance_cores(1), request)) \
            as pool:
        yield pool


def server_request(url: str, request: SessionRequest, request_id: str, timeout: float) -> Timings:
    (result,) = run_sessions(url, [stream_request(request, request_id)], timeout=timeout, keep_data=False)
    if result.error is not None or not result.blocks:
        raise SystemExit(f"error: single stream failed: {result.error}")
    return Timings(dit_ms=[b.timing_ms[0] for b in result.blocks], decode_ms=[b.timing_ms[1] for b in result.blocks],
                   request_s=[result.blocks[-1].arrival_s - (result.sent_s or 0.0)])


def rank_counters(server: TritonServer, ranks: int) -> list[tuple[float, float]]:
    """(loop CPU seconds, session blocks run) of each rank, from the server's metrics endpoint."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    values: dict[tuple[str, int], float] = {}
    for line in text.splitlines():
        if line.startswith(("lingbot_world_loop_cpu_seconds_total{", "lingbot_world_blocks_run_total{")):
            name, value = line.rsplit(" ", 1)
            rank = int(name.split('rank="', 1)[1].split('"', 1)[0])
            values[(name.split("{", 1)[0], rank)] = float(value)
    return [(values.get(("lingbot_world_loop_cpu_seconds_total", r), 0.0),
             values.get(("lingbot_world_blocks_run_total", r), 0.0)) for r in range(ranks)]


def compare(direct: mp.pool.Pool | None, servers: dict[int, TritonServer], request: SessionRequest, repeats: int,
            timeout: float) -> dict[bool, dict[str, Timings]]:
    """decode off/on -> source (direct, SP1, ...) -> timings; the sources take turns, so load on the machine
    reaches all of them alike."""
    out: dict[bool, dict[str, Timings]] = {}
    for decode in (False, True):
        req = dataclasses.replace(request, decode=decode)
        sources = (["direct"] if direct else []) + [f"SP{sp}" for sp in servers]
        out[decode] = {name: Timings() for name in sources}
        before = {sp: rank_counters(s, sp) for sp, s in servers.items()}
        for i in range(repeats):
            if direct:
                out[decode]["direct"].add(direct.apply(_direct_request, (req,)))
            for sp, server in servers.items():
                out[decode][f"SP{sp}"].add(server_request(server.grpc_url, req, f"single-{decode:d}-{i}", timeout))
        for sp, server in servers.items():
            after = rank_counters(server, sp)
            t = out[decode][f"SP{sp}"]
            t.loop_cpu_s = [a[0] - b[0] for a, b in zip(after, before[sp])]
            t.blocks_run = [a[1] - b[1] for a, b in zip(after, before[sp])]
    return out


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


def compare_table(results: dict[bool, dict[str, Timings]]) -> str:
    """A column per source; the first server's ratio to the direct engine, every other server's to the first."""
    names = list(results[False])
    servers = [n for n in names if n != "direct"]
    base = {n: ("direct" if "direct" in names else None) if n == servers[0] else servers[0] for n in servers}
    header = ["one request"] + [c for n in names for c in ([n] if base.get(n) is None else [n, f"{n}/{base[n]}"])]
    m = statistics.median

    def row(label: str, cell: dict[str, str], value: dict[str, float]) -> list[str]:
        out = [label]
        for n in names:
            out.append(cell[n])
            if base.get(n) is not None:
                b = value.get(base[n], float("nan"))
                out.append(f"{value[n] / b:.2f}x" if b > 0 and value[n] == value[n] else "")
        return out

    def metric(label: str, decode: bool, pick: str, scale: str) -> list[str]:
        value = {n: m(getattr(t, pick)) for n, t in results[decode].items()}
        return row(label, {n: f"{v:{scale}}" for n, v in value.items()}, value)

    def loop_cpu(decode: bool) -> list[str]:
        per_rank = {n: [1000.0 * c / b if b else float("nan") for c, b in zip(t.loop_cpu_s, t.blocks_run)]
                    for n, t in results[decode].items() if t.loop_cpu_s is not None}
        cell = {n: "/".join(f"{v:.2f}" for v in per_rank[n]) if n in per_rank else "n/a" for n in names}
        return row(f"control-plane CPU per block, decode {'on' if decode else 'off'} (ms, per rank)", cell,
                   {n: per_rank[n][0] if n in per_rank else float("nan") for n in names})

    rows = [
        metric("DiT per block, decode off (ms)", False, "dit_ms", ".1f"),
        metric("request, decode off (s)", False, "request_s", ".3f"),
        metric("DiT per block, decode on (ms)", True, "dit_ms", ".1f"),
        metric("VAE decode per block, decode on (ms)", True, "decode_ms", ".1f"),
        metric("request, decode on (s)", True, "request_s", ".3f"),
        loop_cpu(False),
        loop_cpu(True),
    ]
    return format_table(header, rows)


def threads_line(degrees: list[int]) -> str:
    """The torch threads each source runs with (the adapter's split, from the same functions)."""
    parts = [f"direct 1 process x {instance_cores(1)}"] if 1 in degrees else []
    for sp in degrees:
        split = CoreSplit.of(instance_cores(sp))
        parts.append(f"SP{sp} {sp} rank{'s' if sp > 1 else ''} x (DiT {split.dit} + decode {split.decode})")
    return f"{os.cpu_count()} CPU cores; torch threads: " + ", ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--sp", type=int, nargs="+", default=[1, 2], help="SP degrees, one server each")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4], help="sessions sent at once")
    parser.add_argument("--rounds", type=int, default=3, help="batches of sessions per concurrency level")
    parser.add_argument("--repeats", type=int, default=5,
                        help="turns of one request per source (decode off, then on) in the direct vs server comparison")
    parser.add_argument("--no-decode", action="store_true", help="concurrency levels skip VAE decoding (latent blocks only)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per stream")
    parser.add_argument("--url", help="use a running server at HOST:PORT instead (no RSS, no direct comparison)")
    add_workload_args(parser, TINY, preset="tiny")
    args = parser.parse_args()
    w = workload_from_args(args)
    checkpoint = ensure_checkpoint(args.checkpoint, args.preset)
    request = make_request(w, decode=not args.no_decode)
    load = os.getloadavg()[0]
    print(f"{w.height}x{w.width}, {w.num_frames} frames = {w.blocks} blocks, {w.dtype}, levels decode {request.decode}, "
          f"{'server ' + args.url if args.url else f'checkpoint {checkpoint}'}", flush=True)
    stats: dict[str, dict[int, LevelStats]] = {}
    comparison: dict[bool, dict[str, Timings]] = {}
    if args.url:
        server_request(args.url, request, "warm-up", args.timeout)
        stats["server"] = {c: run_level(args.url, request, c, args.rounds, args.timeout, []) for c in args.concurrency}
    else:
        print(threads_line(args.sp), flush=True)
        with contextlib.ExitStack() as stack:
            direct = stack.enter_context(direct_engine(checkpoint, w, dataclasses.replace(request, decode=True))) \
                if 1 in args.sp else None
            servers = {sp: stack.enter_context(sp_server(checkpoint, w, sp)) for sp in args.sp}
            for sp, server in servers.items():  # warm-up: Triton spreads them over the ranks
                for i in range(sp):
                    server_request(server.grpc_url, request, f"warm-up-{i}", args.timeout)
            comparison = compare(direct, servers, request, args.repeats, args.timeout)
            print("direct vs servers done", flush=True)
            for sp, server in servers.items():
                pids = stub_pids(server, sp)
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
    if comparison:
        print()
        print(f"The same request to each source in turn, {args.repeats} times with decode off, then {args.repeats} "
              f"with decode on; medians over blocks and requests:")
        print(compare_table(comparison))
    print(f"\nload average (1 min) of the machine, before / after: {load:.2f} / {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
