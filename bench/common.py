"""Shared by the benchmarks: workloads, checkpoints, the per-rank rollout, a CUDA process group, tables."""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from backend.engine.settings import EngineSettings
from backend.engine.rollout import WorldModelEngine
from backend.launch.paths import REPO_ROOT
from backend.launch.server import STUB_THREAD_ENVIRONMENT
from backend.parallel.group import GroupHandles
from backend.parallel.local import free_port, run_group
from backend.parallel.mesh import Mesh
from backend.parallel.sequence import SequenceParallel
from backend.serving.settings import ServingSettings
from backend.serving.threads import instance_cores
from backend.api.contract import BLOCK_FRAMES, video_frames_for
from backend.api.request import SessionRequest
from backend.api.errors import ConfigError
from backend.api.settings import to_parameters
from backend.model.layouts import resolve_layout
from backend.model.tiny_checkpoint import PRESETS, ensure_current
from client.camera import camera_preset

BUILD_DIR = REPO_ROOT / "build"
PROMPT = "a car driving forward on a road in the city at sunset"


@dataclass(frozen=True)
class Workload:
    """One request's size plus the engine settings that shape its cost."""

    height: int
    width: int
    blocks: int  # AR blocks of BLOCK_FRAMES latent frames (engine_settings sets it, whichever the layout)
    dtype: str
    window_frames: int
    sink_frames: int
    seed: int = 42
    camera: str = "forward"

    @property
    def num_frames(self) -> int:
        return video_frames_for(self.blocks * BLOCK_FRAMES)


# The test suite's tiny-model settings (5 blocks: the 9-frame window fills, then slides past the sink).
TINY = Workload(height=64, width=64, blocks=5, dtype="float32", window_frames=9, sink_frames=3)
# The real LingBot-World workload: 480x832, 81 frames (7 blocks), the official window and sink.
GPU = Workload(height=480, width=832, blocks=7, dtype="bfloat16", window_frames=18, sink_frames=6)


def add_checkpoint_args(parser: argparse.ArgumentParser, preset: str) -> None:
    parser.add_argument("--checkpoint", type=Path, help="checkpoint directory (either download); if omitted, "
                        "a random --preset checkpoint in build/checkpoints/PRESET, written if absent")
    parser.add_argument("--preset", choices=sorted(PRESETS), default=preset, help="random checkpoint size")


def add_workload_args(parser: argparse.ArgumentParser, default: Workload, preset: str) -> None:
    add_checkpoint_args(parser, preset)
    add_request_args(parser, default)


def add_request_args(parser: argparse.ArgumentParser, default: Workload) -> None:
    """The workload's size and engine settings (every Workload field but the camera)."""
    g = parser.add_argument_group("workload")
    g.add_argument("--height", type=int, default=default.height)
    g.add_argument("--width", type=int, default=default.width)
    g.add_argument("--blocks", type=int, default=default.blocks,
                   help=f"AR blocks per request ({default.blocks} = {default.num_frames} frames)")
    g.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=default.dtype)
    g.add_argument("--window-frames", type=int, default=default.window_frames, help="latent frames in the KV window")
    g.add_argument("--sink-frames", type=int, default=default.sink_frames)
    g.add_argument("--seed", type=int, default=default.seed)


def workload_from_args(args: argparse.Namespace) -> Workload:
    names = [f.name for f in dataclasses.fields(Workload) if f.name != "camera"]
    return Workload(**{n: getattr(args, n) for n in names})


def ensure_checkpoint(path: Path | None, preset: str) -> Path:
    """`path` as given, or the random `preset` checkpoint under build/checkpoints (written on first use)."""
    if path is not None:
        try:
            resolve_layout(str(path))
        except ConfigError as exc:
            raise SystemExit(f"error: {exc}") from exc
        return path
    root = BUILD_DIR / "checkpoints" / preset
    if ensure_current(root, preset):
        print(f"wrote a random {preset!r} checkpoint to {root}", flush=True)
    return root


def engine_settings(checkpoint: Path, w: Workload, sp: int, device: str = "cpu", tp: int = 1) -> EngineSettings:
    return EngineSettings(
        checkpoint=str(checkpoint), sp_degree=sp, tp_degree=tp, dtype=w.dtype, device=device, block_frames=BLOCK_FRAMES,
        window_frames=w.window_frames, sink_frames=w.sink_frames, default_height=w.height, default_width=w.width,
    )


def server_parameters(settings: EngineSettings) -> dict[str, str]:
    """config.pbtxt parameters serving exactly `settings`, on a free rendezvous port (the instance group sets the
    device)."""
    return to_parameters(settings) | to_parameters(ServingSettings(rendezvous_port=free_port()))


def make_request(w: Workload, decode: bool = True) -> SessionRequest:
    image = np.random.default_rng(w.seed).integers(0, 256, (w.height, w.width, 3), dtype=np.uint8)
    return SessionRequest(image=image, prompt=PROMPT, poses=camera_preset(w.camera, w.num_frames),
                          num_frames=w.num_frames, seed=w.seed, height=w.height, width=w.width, decode=decode)


# ---------------------------------------------------------------- the rollout every rank runs


@dataclass
class RankResult:
    attention: str
    block_ms: list[float]  # run_block wall time (DiT forwards + all-to-all) per block
    a2a_bytes: list[int]  # bytes this rank sent by all-to-all, per block
    all_reduce_bytes: list[int]  # this rank's TP all-reduce payload, per block
    all_gather_bytes: list[int]  # this rank's TP all-gather payload, per block
    weight_bytes: int  # the transformer's weights on this rank
    cache_bytes: int  # the timed session's self-attention window and prompt K/V on this rank
    decode_ms: list[float]  # this rank's VAE decode per block (its band of rows with split_decode)
    request_s: float  # open_session .. last block decoded (every rank its band, rank 0 the frames)
    peak_cuda_bytes: int | None  # torch.cuda.max_memory_allocated over the process (weights included)


def rollout(groups: GroupHandles, settings: EngineSettings, request: SessionRequest, warmup_blocks: int) -> RankResult:
    """One warm-up session of `warmup_blocks`, then one timed full request (on settings.tp_degree x sp_degree
    ranks). Importable for spawned ranks."""
    if settings.device == "cuda":
        settings = dataclasses.replace(settings, device=f"cuda:{torch.cuda.current_device()}")
    sp = SequenceParallel(groups.data)
    engine = WorldModelEngine.load(settings, sp, groups.decode, Mesh.build(sp, settings.tp_degree, timeout_s=900))
    with engine.session(request) as warm:
        for _ in zip(range(warmup_blocks), engine.blocks(warm, decode=False)):
            pass
    start = time.perf_counter()
    with engine.session(request) as session:
        # Every rank decodes its band of each block (split_decode); rank 0 gets the frames, as an owner does.
        outputs, decode_ms = [], []
        for out in (out for out, _ in engine.blocks(session, decode=False)):
            outputs.append(out)
            begin = time.perf_counter()
            engine.decode(session.decoding, out)
            decode_ms.append((time.perf_counter() - begin) * 1000.0)
        cache_bytes = session.cache_bytes()
    cuda = engine.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(engine.device)
    return RankResult(
        attention=engine.attention_name,
        block_ms=[o.dit_ms for o in outputs],
        a2a_bytes=[o.all_to_all_bytes for o in outputs],
        all_reduce_bytes=[o.all_reduce_bytes for o in outputs],
        all_gather_bytes=[o.all_gather_bytes for o in outputs],
        weight_bytes=engine.transformer.weight_bytes(),
        cache_bytes=cache_bytes,
        decode_ms=decode_ms,
        request_s=time.perf_counter() - start,
        peak_cuda_bytes=torch.cuda.max_memory_allocated(engine.device) if cuda else None,
    )


# ---------------------------------------------------------------- process groups: CPU (gloo), one process per GPU (NCCL)


def use_stub_thread_environment() -> None:
    """Processes spawned from now on (ranks, the direct engine) start with the server stubs' thread settings."""
    for key, value in STUB_THREAD_ENVIRONMENT.items():
        os.environ.setdefault(key, value)


def run_cpu_group(world: int, fn: Callable[..., Any], args: tuple = ()) -> list:
    """fn(groups, *args) on `world` processes joined by gloo, each with its share of the cores' torch threads and the
    stubs' thread settings, as a server's CPU instances run (SP1 gets every core, SPn's ranks share them)."""
    use_stub_thread_environment()
    return run_group(world, fn, args, threads=instance_cores(world))


def sp_parser(doc: str, default: Workload, preset: str) -> argparse.ArgumentParser:
    """The command line shared by the SP sweeps (bench.engine on CPU, bench.gpu on GPUs)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--sp", type=int, nargs="+", default=[1, 2, 4], help="SP degrees, the first is the baseline")
    parser.add_argument("--tp", type=int, nargs="+", default=[1],
                        help="TP degrees: every TP x SP pair runs on tp x sp ranks (TP1 first: the baseline)")
    parser.add_argument("--warmup-blocks", type=int, default=1, help="blocks of a throw-away session first")
    add_workload_args(parser, default, preset=preset)
    return parser


Grid = tuple[int, int]  # (tp, sp): a TP x SP rank grid


def grid_label(grid: Grid) -> str:
    tp, sp = grid
    return f"SP{sp}" if tp == 1 else f"TP{tp}xSP{sp}"


def sweep_sp(
    grids: Sequence[Grid],
    run: Callable[..., list],
    checkpoint: Path,
    w: Workload,
    warmup_blocks: int,
    device: str = "cpu",
) -> dict[Grid, list[RankResult]]:
    """The same request at each (tp, sp) grid, one group of tp x sp ranks after another; `run` is
    run_cpu_group or run_cuda_group."""
    request = make_request(w)
    results: dict[Grid, list[RankResult]] = {}
    for tp, sp in grids:
        settings = engine_settings(checkpoint, w, sp, device, tp)
        results[tp, sp] = run(tp * sp, rollout, (settings, request, warmup_blocks))
        lead = results[tp, sp][0]
        print(f"{grid_label((tp, sp))} done: {lead.request_s:.2f} s, attention {lead.attention}", flush=True)
    print()
    return results


def grids_of(args: argparse.Namespace, most_ranks: int | None = None) -> list[Grid]:
    """Every --tp x --sp pair (TP outer), those with more than `most_ranks` ranks left out."""
    return [(tp, sp) for tp in args.tp for sp in args.sp if most_ranks is None or tp * sp <= most_ranks]


def cuda_device_count() -> int:
    """Visible GPUs; exits with a clear message where CUDA is absent."""
    if not torch.cuda.is_available():
        raise SystemExit(f"error: CUDA is not available (torch {torch.__version__}, no GPU or a CPU-only build); "
                         "this benchmark needs NVIDIA GPUs; on CPU run python -m bench.engine")
    return torch.cuda.device_count()


def run_cuda_group(world: int, fn: Callable[..., Any], args: tuple = (), timeout_s: float = 900) -> list:
    """fn(sp, *args) on `world` spawned processes, rank r on cuda:r, joined by NCCL; results in rank order."""
    if cuda_device_count() < world:
        raise SystemExit(f"error: SP{world} needs {world} GPUs, {torch.cuda.device_count()} visible")
    return run_group(world, fn, args, timeout_s=timeout_s, backend="nccl")


# ---------------------------------------------------------------- tables


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1) -> str:
    """A markdown table, columns padded: the first `left` ones left-aligned, the rest right-aligned."""
    cells = [list(header), *[list(r) for r in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]

    def line(row: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))) + " |"

    rule = "|" + "|".join("-" * (w + 2) if i < left else "-" * (w + 1) + ":" for i, w in enumerate(widths)) + "|"
    return "\n".join([line(cells[0]), rule, *map(line, cells[1:])])


def sp_table(results: dict[Grid, list[RankResult]]) -> str:
    """Per-block ms (rank 0), mean, request s, speedups vs the first grid, bytes per rank (weights, one
    session's caches), exchange bytes per block (all-to-all sent; TP all-reduce and all-gather payload), peak
    CUDA memory. Columns in the order run."""
    grids = list(results)
    lead = {k: results[k][0] for k in grids}
    base = grid_label(grids[0])
    base_mean = statistics.fmean(lead[grids[0]].block_ms)
    base_request = lead[grids[0]].request_s
    rows = [[f"block {i} (ms)", *[f"{lead[k].block_ms[i]:.1f}" for k in grids]]
            for i in range(len(lead[grids[0]].block_ms))]
    rows.append(["mean block (ms)", *[f"{statistics.fmean(lead[k].block_ms):.1f}" for k in grids]])
    rows.append([f"speedup vs {base} (mean block)",
                 *[f"{base_mean / statistics.fmean(lead[k].block_ms):.2f}x" for k in grids]])
    rows.append(["VAE decode per block, mean (ms)", *[f"{statistics.fmean(lead[k].decode_ms):.1f}" for k in grids]])
    rows.append(["whole request (s)", *[f"{lead[k].request_s:.2f}" for k in grids]])
    rows.append([f"speedup vs {base} (request)", *[f"{base_request / lead[k].request_s:.2f}x" for k in grids]])
    rows.append(["DiT weights per rank", *[_bytes_cell([r.weight_bytes] for r in results[k]) for k in grids]])
    rows.append(["one session's KV + text cache per rank", *[_bytes_cell([r.cache_bytes] for r in results[k])
                                                             for k in grids]])
    for name, field in (("all-to-all sent", "a2a_bytes"), ("TP all-reduce", "all_reduce_bytes"),
                        ("TP all-gather", "all_gather_bytes")):
        rows.append([f"{name} per rank per block", *[_bytes_cell((getattr(r, field) for r in results[k]), per_block=True)
                                                     for k in grids]])
    if lead[grids[0]].peak_cuda_bytes is not None:
        rows.append(["peak CUDA MiB per rank", *["/".join(f"{(r.peak_cuda_bytes or 0) / 2**20:.0f}" for r in results[k])
                                                 for k in grids]])
    return format_table(["", *map(grid_label, grids)], rows)


def _bytes_cell(per_rank: Iterable[list[int]], per_block: bool = False) -> str:
    """Bytes equal on every rank (and block: 'constant') shown once, else their range."""
    values = [b for rank in per_rank for b in rank]
    if len(set(values)) == 1:
        return f"{values[0]:,} B" + (" (constant)" if per_block and values[0] else "")
    return f"{min(values):,}..{max(values):,} B (" + ("VARIES" if per_block else "differ by rank") + ")"


def percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")
