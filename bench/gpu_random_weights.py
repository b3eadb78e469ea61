"""`python -m bench.gpu --random-weights`: the published 14B geometry at SP1 with random weights, no checkpoint.

    python -m bench.gpu --random-weights [--modes eager compiled] [--profile]   # one GPU: 14B, 480x832, 81 frames
    python -m bench.gpu --random-weights --dry-run [--profile]                  # the same code on CPU, tiny preset

The DiT (bf16, built tensor by tensor on the device), a Wan 2.1 VAE (float32) and a stand-in prompt encoder
(random [1, 512, 4096] states in place of umT5-XXL, which runs once per session, outside the block time) are
made in memory, shared by the modes: eager first, then the same weights compiled per block. Each mode runs one
throw-away request, then one timed request decoded the way the server does it (block i decodes on a writer
thread while block i+1 runs; the VAE uses a side stream on GPU). Forward times come from CUDA events around
the transformer's forward (hooks), block times are `run_block`'s. `--profile` then runs a fresh session up to
its first full-window block and prints the torch profiler's top ops for that block.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from backend.api.request import SessionRequest
from backend.engine.settings import EngineSettings
from backend.engine.blocks import BlockOutput
from backend.engine.parts import EngineParts
from backend.engine.rollout import WorldModelEngine
from backend.engine.session import Session
from backend.engine.validation import spec_from_configs
from backend.model.config import CheckpointConfigs, TransformerConfig, VaeConfig
from backend.model.dtypes import torch_dtype
from backend.model.layout_diffusers import DIFFUSERS
from backend.model.random_weights import WAN21_VAE, RandomPromptStates, random_transformer, random_vae
from backend.model.tiny_checkpoint import PRESETS, transformer_config, vae_arguments
from bench.common import (
    GPU,
    Workload,
    add_request_args,
    cuda_device_count,
    format_table,
    make_request,
    workload_from_args,
)
from bench.flops import block_keys, forward_flops
from bench.timing import Clock, ForwardTimer

# The published reference on one H200, SP1, 480x832, 81 frames, bf16, torch.compile on.
REFERENCE = {"block_ms": 2397.0, "request_s": 17.7, "peak_allocated_gib": 69.3}
BF16_MATMUL_TFLOPS = 790.0  # a bf16 matrix product on an H200 (bench/README has the measurement)
# Its full-window block: 5 forwards of 4,680 tokens (3 x 30 x 52) over 18 x 1,560 keys, each with the camera
# branch (the reference runs it in every forward), about 1,307 TFLOP.
REFERENCE_BLOCK_FLOP = 5 * forward_flops(TransformerConfig.lingbot_14b(), 3 * 1560, 18 * 1560).total
DRY_RUN = Workload(height=64, width=64, blocks=3, dtype="bfloat16", window_frames=9, sink_frames=3)
GIB = 2**30


@dataclass
class BlockTiming:
    index: int
    keys: int  # self-attention keys of each of its forwards
    forwards_ms: list[float]  # 4 denoise forwards, then the commit (device timeline)
    condition_ms: float  # the VAE encoder's calls for the first-frame condition inside run_block
    block_ms: float  # run_block: condition encode, noise, the 5 forwards, up to the device sync
    decode_ms: float  # the VAE decode of this block on the writer thread
    flop: float  # the 5 forwards


@dataclass
class ModeRun:
    mode: str
    blocks: list[BlockTiming]
    request_s: float  # open_session .. last block decoded
    decode_overlap: float  # share of the decode wall time that ran while a block's run_block ran
    peak_allocated: int | None
    peak_reserved: int | None

    def full_window(self) -> list[BlockTiming]:
        widest = max(b.keys for b in self.blocks)
        return [b for b in self.blocks if b.keys == widest]


# ---------------------------------------------------------------- the engine, from memory


def model_configs(preset: str) -> tuple[TransformerConfig, dict]:
    """The DiT config and VAE architecture of '14b' (the published model) or a random-checkpoint preset."""
    if preset == "14b":
        return TransformerConfig.lingbot_14b(), WAN21_VAE
    return transformer_config(PRESETS[preset]), vae_arguments(PRESETS[preset])


def engine_settings(w: Workload, device: str, compile: bool) -> EngineSettings:
    return EngineSettings(checkpoint="(random weights in memory)", dtype=w.dtype, device=device, compile=compile,
                        window_frames=w.window_frames, sink_frames=w.sink_frames, default_height=w.height,
                        default_width=w.width)


def build_parts(transformer: TransformerConfig, vae: dict, dtype: torch.dtype, device: torch.device,
                seed: int) -> EngineParts:
    return EngineParts(
        transformer=random_transformer(transformer, dtype, device, seed),
        prompts=RandomPromptStates(transformer.text_len, transformer.text_dim, dtype, device, seed),
        vae=random_vae(vae, device, seed),
    )


def build_engine(settings: EngineSettings, transformer: TransformerConfig, vae: dict,
                 parts: EngineParts) -> WorldModelEngine:
    ckpt = CheckpointConfigs(transformer, VaeConfig.from_dict(vae), None, DIFFUSERS.source_defaults)
    return WorldModelEngine(spec_from_configs(settings, ckpt, world_size=1), parts=parts)


# ---------------------------------------------------------------- one request, timed


def timed_request(engine: WorldModelEngine, request: SessionRequest, mode: str) -> ModeRun:
    """One request: blocks on this thread, each block's decode on a writer thread while the next block runs."""
    cuda = engine.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(engine.device)
    tcfg = engine.ckpt.transformer
    dit: list[tuple[float, float]] = []
    blocks: list[tuple[int, list[float], float, float]] = []
    clock = Clock(engine.device)
    start = time.perf_counter()
    with ForwardTimer(engine.transformer, clock) as timer, ForwardTimer(engine.conditions.vae.encoder, clock) as encoder, \
            ThreadPoolExecutor(1) as writer, engine.session(request) as session:
        decodes = []
        while not session.done:
            t0 = time.perf_counter()
            (out,) = engine.run_block([session])
            dit.append((t0, time.perf_counter()))
            # run_block ended in a device sync: every mark of the block is complete
            blocks.append((out.block_index, timer.take(), sum(encoder.take()), out.dit_ms))
            decodes.append(writer.submit(_timed_decode, engine, session, out))
        decoded = [d.result() for d in decodes]
    request_s = time.perf_counter() - start
    g = session.geometry
    timings = []
    for (index, forwards, condition_ms, block_ms), (d0, d1) in zip(blocks, decoded):
        keys = block_keys(index, g.block_frames, engine.window_frames, g.tokens_per_frame)
        flop = forward_flops(tcfg, g.block_tokens, keys).block(len(forwards))
        timings.append(BlockTiming(index, keys, forwards, condition_ms, block_ms, (d1 - d0) * 1000.0, flop))
    decode_s = sum(d1 - d0 for d0, d1 in decoded)
    overlap_s = sum(_overlap(d, b) for d in decoded for b in dit)
    return ModeRun(
        mode=mode,
        blocks=timings,
        request_s=request_s,
        decode_overlap=overlap_s / decode_s if decode_s else 0.0,
        peak_allocated=torch.cuda.max_memory_allocated(engine.device) if cuda else None,
        peak_reserved=torch.cuda.max_memory_reserved(engine.device) if cuda else None,
    )


def _timed_decode(engine: WorldModelEngine, session: Session, out: BlockOutput) -> tuple[float, float]:
    start = time.perf_counter()
    engine.decode(session.decoding, out)  # returns host frames: the side stream has finished
    return start, time.perf_counter()


def _overlap(a: tuple[float, float], b: tuple[float, float]) -> float:
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


def warm_up(engine: WorldModelEngine, request: SessionRequest, blocks: int) -> None:
    """A throw-away session of `blocks` blocks, decoded (compiles, autotunes, allocator pools)."""
    with engine.session(request) as session:
        for _ in zip(range(blocks), engine.blocks(session)):
            pass


# ---------------------------------------------------------------- profile of one full-window block


def profile_full_window_block(engine: WorldModelEngine, request: SessionRequest, rows: int) -> str:
    """Torch-profiler table of the first full-window block of a fresh session: top ops by self device time
    (CPU time on CPU), and the attention kernels among them."""
    cuda = engine.device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with engine.session(request) as session:
        bf = session.geometry.block_frames
        while (session.block_index + 1) * bf < engine.window_frames:
            engine.run_block([session])
        if session.done:
            raise SystemExit(f"error: the request ends before its window ({engine.window_frames} frames) is full")
        index = session.block_index
        with torch.profiler.profile(activities=activities) as prof:
            engine.run_block([session])
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = sorted((e for e in prof.key_averages() if getattr(e, key) > 0), key=lambda e: getattr(e, key), reverse=True)
    total_us = sum(getattr(e, key) for e in events)
    table = format_table(
        ["op / kernel", "calls", "self time (ms)", "share"],
        [[_short(e.key), str(e.count), f"{getattr(e, key) / 1000:.1f}", f"{getattr(e, key) / total_us:.1%}"]
         for e in events[:rows]],
    )
    attention = sorted({_short(e.key) for e in prof.key_averages() if _is_attention(e.key)})
    where = "device" if cuda else "CPU"
    return (f"profile of block {index} (full window), top {rows} by self {where} time, {total_us / 1000:.1f} ms in all\n"
            f"{table}\nattention kernels in the profile: {', '.join(attention) or 'none found'}")


def _short(name: str, width: int = 90) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def _is_attention(name: str) -> bool:
    """SDPA's ops (which backend it chose) and the flash / memory-efficient / cuDNN attention kernels."""
    return any(k in name.lower() for k in ("scaled_dot_product", "flash", "fmha", "sdpa", "attention"))


# ---------------------------------------------------------------- tables


def block_table(run: ModeRun) -> str:
    """Per block: keys, the 4 denoise forwards and the commit, their sum, run_block, TFLOP/s, decode."""
    rows = []
    for b in run.blocks:
        forwards = sum(b.forwards_ms)
        rows.append([str(b.index), f"{b.keys:,}", *[f"{ms:.1f}" for ms in b.forwards_ms], f"{forwards:.1f}",
                     f"{b.condition_ms:.1f}", f"{b.block_ms:.1f}", _num(b.flop / forwards / 1e9), f"{b.decode_ms:.1f}"])
    header = ["block", "keys", *[f"denoise {k + 1} (ms)" for k in range(len(run.blocks[0].forwards_ms) - 1)],
              "commit (ms)", "5 forwards (ms)", "condition encode (ms)", "run_block (ms)", "TFLOP/s (forwards)",
              "VAE decode (ms)"]
    return format_table(header, rows, left=1)


def summary_table(runs: list[ModeRun], cuda: bool) -> str:
    """The modes side by side with the published reference (its TFLOP/s from this FLOP model)."""
    na = "n/a (CPU)"

    def row(label: str, fn, reference: str = "-") -> list[str]:
        return [label, *[fn(r) for r in runs], reference]

    def block_ms(r: ModeRun) -> float:
        return statistics.median(b.block_ms for b in r.full_window())

    def tflops(r: ModeRun) -> float:
        return r.full_window()[0].flop / block_ms(r) / 1e9

    def gib(value: int | None) -> str:
        return f"{value / GIB:.1f}" if value is not None else na

    ref_tflops = REFERENCE_BLOCK_FLOP / REFERENCE["block_ms"] / 1e9
    rows = [
        row("full-window block: run_block, median (ms)", lambda r: f"{block_ms(r):.1f}", f"{REFERENCE['block_ms']:,.0f}"),
        row("full-window block: 5 forwards, median (ms)",
            lambda r: f"{statistics.median(sum(b.forwards_ms) for b in r.full_window()):.1f}"),
        row("full-window block: commit forward, median (ms)",
            lambda r: f"{statistics.median(b.forwards_ms[-1] for b in r.full_window()):.1f}"),
        row("full-window block: condition encode, median (ms)",
            lambda r: f"{statistics.median(b.condition_ms for b in r.full_window()):.1f}"),
        row("whole request (s)", lambda r: f"{r.request_s:.2f}", f"{REFERENCE['request_s']}"),
        row("VAE decode per block, median (ms)", lambda r: f"{statistics.median(b.decode_ms for b in r.blocks):.1f}"),
        row("VAE decode overlapped with the DiT", lambda r: f"{r.decode_overlap:.0%} of its time"),
        row("peak allocated (GiB)", lambda r: gib(r.peak_allocated), f"{REFERENCE['peak_allocated_gib']}"),
        row("peak reserved (GiB)", lambda r: gib(r.peak_reserved)),
        row("FLOP per full-window block (TFLOP)", lambda r: _num(r.full_window()[0].flop / 1e12),
            f"{REFERENCE_BLOCK_FLOP / 1e12:,.1f}"),
        row("achieved TFLOP/s (full-window run_block)", lambda r: _num(tflops(r)), f"{ref_tflops:.0f}"),
        row(f"fraction of {BF16_MATMUL_TFLOPS:.0f} TFLOP/s", lambda r: f"{tflops(r) / BF16_MATMUL_TFLOPS:.1%}" if cuda else na,
            f"{ref_tflops / BF16_MATMUL_TFLOPS:.0%}"),
    ]
    return format_table(["", *[r.mode for r in runs], "reference (H200, compiled)"], rows)


def _num(x: float) -> str:
    """One decimal from 1 up (TFLOP at the real size), two significant digits below (the tiny dry run)."""
    return f"{x:,.1f}" if x >= 1 else f"{x:.2g}"


# ---------------------------------------------------------------- command line


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu --random-weights", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--dry-run", action="store_true",
                        help="on CPU with the tiny preset: 64x64, 3 blocks, window 9 (shapes and code paths only)")
    parser.add_argument("--preset", choices=["14b", *sorted(PRESETS)], default="14b",
                        help="14b: the published model; else a random-checkpoint preset's geometry")
    parser.add_argument("--modes", nargs="+", choices=("eager", "compiled"), default=["eager", "compiled"])
    parser.add_argument("--warmup-blocks", type=int, help="blocks of the throw-away request (default: all)")
    parser.add_argument("--profile", action="store_true", help="profile one full-window block after the last mode")
    parser.add_argument("--profile-rows", type=int, default=25)
    add_request_args(parser, GPU)
    args = parser.parse_args(argv)
    if args.dry_run:
        args.preset = "tiny"
        for name, value in dataclasses.asdict(DRY_RUN).items():
            setattr(args, name, value)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not args.dry_run:
        cuda_device_count()  # exits with a clear message where CUDA is absent
    device = torch.device("cpu" if args.dry_run else f"cuda:{torch.cuda.current_device()}")
    w = workload_from_args(args)
    transformer, vae = model_configs(args.preset)
    dtype = torch_dtype(w.dtype)
    start = time.perf_counter()
    parts = build_parts(transformer, vae, dtype, device, w.seed)
    built_s = time.perf_counter() - start
    params = sum(p.numel() for p in parts.transformer.parameters())
    cuda = device.type == "cuda"
    print(f"random weights ({args.preset}: {params / 1e9:.2f} B DiT parameters, {w.dtype}) made on "
          f"{torch.cuda.get_device_name(device) if cuda else 'CPU'} in {built_s:.1f} s; torch {torch.__version__}; "
          f"{w.height}x{w.width}, {w.num_frames} frames = {w.blocks} blocks, window {w.window_frames}, "
          f"sink {w.sink_frames}, SP1", flush=True)
    print(f"prompt encoder: random stand-in states {list(parts.prompts.shape)} (umT5-XXL not loaded: it runs once "
          "per session, outside the block time; the reference's peak memory includes its ~11 GB)", flush=True)
    request = make_request(w)
    runs = []
    for mode in args.modes:
        engine = build_engine(engine_settings(w, str(device), mode == "compiled"), transformer, vae, parts)
        start = time.perf_counter()
        warm_up(engine, request, args.warmup_blocks or w.blocks)
        print(f"{mode}: attention {engine.attention_name}, warm-up {time.perf_counter() - start:.1f} s", flush=True)
        runs.append(timed_request(engine, request, mode))
        print(f"\n{mode}, per block (CUDA events on GPU, wall time on CPU):\n{block_table(runs[-1])}\n", flush=True)
    print(summary_table(runs, cuda), flush=True)
    if args.profile:
        print("\n" + profile_full_window_block(engine, make_request(w, decode=False), args.profile_rows), flush=True)
