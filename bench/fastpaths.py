"""Fast paths against the exact path, in one table: forwards and FLOP per block at the 14B geometry, CPU DiT time
and the latents' distance from the exact path.

    python -m bench.fastpaths [--preset mid] [--blocks 8] [--height 64 --width 64]

Each row is one fast path (a setting, off by default: EngineSettings.kv_reuse, window_frames / sink_frames): the
exact path (window 18, sink 6, the commit forward), kv_reuse, smaller windows and sinks, kv_reuse with the
smallest window.

* 14B columns (no run): one full-window block of the published model (480x832, 3 latent frames of 1,560 tokens
  a block) from bench/flops' FLOP model: its forwards (EngineSettings.forwards_per_block), TFLOP, the bound of a
  bf16 H200 at 790 TFLOP/s (SP1, matrix products only), one session's self-attention cache at SP1 in bf16
  (model/memory.self_cache_bytes) and the K/V the block's forwards read.
* CPU columns (one run, SP1): one set of random `--preset` weights in float32 shared by an engine per fast path;
  one throw-away block each, then one `--blocks` session each, the paths taking turns block by block so that the
  machine's load falls alike on all of them. DiT time: the transformer's forwards (hooks), summed over the
  blocks; the ratio is against the exact path's, beside the median of the per-block ratios (a block that the
  machine's load hits moves the sums, less so the median). Distance: the latents of all the blocks against the
  exact path's (same seed, camera, prompt states), max and mean abs difference.

The decoder's fast path (`decoder=tiny`) changes none of these figures (the DiT and its latents are the same): its
decode time against the Wan VAE's is `python -m bench.decode --decoder tiny` (bench/README section 16).
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch

from backend.engine.settings import EngineSettings
from backend.model.config import TransformerConfig
from backend.model.dtypes import torch_dtype
from backend.model.memory import self_cache_bytes
from backend.model.tiny_checkpoint import PRESETS
from bench import gpu_random_weights
from bench.common import GPU, Workload, format_table, make_request
from bench.flops import forward_flops
from bench.gpu_random_weights import BF16_MATMUL_TFLOPS
from bench.timing import Clock, ForwardTimer

BLOCK_FRAMES = 3
TOKENS_PER_FRAME_14B = 30 * 52  # 480x832: 60x104 latents, 2x2 patches
BF16_BYTES = 2
CPU = Workload(height=64, width=64, blocks=8, dtype="float32", window_frames=GPU.window_frames,
               sink_frames=GPU.sink_frames)


@dataclass(frozen=True)
class FastPath:
    name: str
    kv_reuse: bool = False
    window_frames: int = GPU.window_frames
    sink_frames: int = GPU.sink_frames

    def settings(self, base: EngineSettings) -> EngineSettings:
        return dataclasses.replace(base, kv_reuse=self.kv_reuse, window_frames=self.window_frames,
                                   sink_frames=self.sink_frames)


EXACT = FastPath("exact (window 18, sink 6)")
PATHS = (
    EXACT,
    FastPath("kv_reuse", kv_reuse=True),
    FastPath("window 15, sink 3", window_frames=15, sink_frames=3),
    FastPath("window 9, sink 3", window_frames=9, sink_frames=3),
    FastPath("kv_reuse + window 9, sink 3", kv_reuse=True, window_frames=9, sink_frames=3),
)


# ---------------------------------------------------------------- 14B: one full-window block, no run


@dataclass(frozen=True)
class BlockCost:
    forwards: int
    flop: float
    cache_bytes: int  # one session's self-attention window, SP1, bf16
    kv_read_bytes: int  # the cached K/V every forward's self-attention reads, summed over the block's forwards


def full_window_cost(cfg: TransformerConfig, settings: EngineSettings) -> BlockCost:
    """One block whose history fills the window (the steady state of a long session) at the 14B geometry."""
    tokens = BLOCK_FRAMES * TOKENS_PER_FRAME_14B
    keys = settings.window_frames * TOKENS_PER_FRAME_14B
    forwards = settings.forwards_per_block
    return BlockCost(
        forwards=forwards,
        flop=forward_flops(cfg, tokens, keys).block(forwards),
        cache_bytes=self_cache_bytes(cfg, settings.window_frames * TOKENS_PER_FRAME_14B, 1, BF16_BYTES),
        kv_read_bytes=forwards * self_cache_bytes(cfg, keys, 1, BF16_BYTES),
    )


# ---------------------------------------------------------------- CPU: one run, the paths taking turns


@dataclass
class PathRun:
    dit_ms: list[float]  # per block: the transformer's forwards
    forwards: list[int]  # per block
    latents: np.ndarray  # [1, z, frames, h, w], every block


def base_settings(w: Workload) -> EngineSettings:
    return dataclasses.replace(gpu_random_weights.engine_settings(w, "cpu", False), block_frames=BLOCK_FRAMES)


def measure(preset: str, w: Workload, paths: tuple[FastPath, ...]) -> list[PathRun]:
    """An engine per path on one set of random weights; a warm-up block each, then the timed sessions, one
    block of each path in turn."""
    transformer, vae = gpu_random_weights.model_configs(preset)
    parts = gpu_random_weights.build_parts(transformer, vae, torch_dtype(w.dtype), torch.device("cpu"), w.seed)
    base = base_settings(w)
    engines = [gpu_random_weights.build_engine(p.settings(base), transformer, vae, parts) for p in paths]
    request = make_request(w, decode=False)
    for engine in engines:
        with engine.session(request) as warm:
            engine.run_block([warm])
    runs = [PathRun([], [], np.empty(0)) for _ in paths]
    latents: list[list[np.ndarray]] = [[] for _ in paths]
    sessions = [e.open_session(request, e.geometry_of(request)) for e in engines]
    with ForwardTimer(parts.transformer, Clock(torch.device("cpu"))) as timer:
        while not sessions[0].done:
            first = sessions[0].block_index % len(paths)  # each block another path goes first
            for i in (*range(first, len(paths)), *range(first)):
                engine, session, run, kept = engines[i], sessions[i], runs[i], latents[i]
                (out,) = engine.run_block([session])
                forwards = timer.take()
                run.dit_ms.append(sum(forwards))
                run.forwards.append(len(forwards))
                kept.append(out.latents.numpy())
            print(f"block {sessions[0].block_index - 1}: DiT ms " + ", ".join(f"{r.dit_ms[-1]:.0f}" for r in runs),
                  flush=True)
    for engine, session, run, kept in zip(engines, sessions, runs, latents):
        engine.close_session(session)
        run.latents = np.concatenate(kept, axis=2)
    return runs


# ---------------------------------------------------------------- the table


def table(paths: tuple[FastPath, ...], base: EngineSettings, runs: list[PathRun]) -> str:
    cfg = TransformerConfig.lingbot_14b()
    costs = [full_window_cost(cfg, p.settings(base)) for p in paths]
    exact_cost, exact_run = costs[0], runs[0]
    exact_ms = sum(exact_run.dit_ms)
    rows = []
    for path, cost, run in zip(paths, costs, runs):
        diff = np.abs(run.latents - exact_run.latents)
        rows.append([
            path.name,
            str(cost.forwards),
            f"{cost.flop / 1e12:,.0f}",
            f"{cost.flop / exact_cost.flop:.2f}",
            f"{cost.flop / (BF16_MATMUL_TFLOPS * 1e12) * 1e3:,.0f}",
            f"{cost.cache_bytes / 1e9:.1f}",
            f"{cost.kv_read_bytes / 1e9:.0f}",
            "/".join(sorted({str(f) for f in run.forwards})),
            f"{sum(run.dit_ms) / len(run.dit_ms):,.0f}",
            f"{sum(run.dit_ms) / exact_ms:.2f}",
            f"{statistics.median(a / b for a, b in zip(run.dit_ms, exact_run.dit_ms)):.2f}",
            f"{diff.max():.3g}",
            f"{diff.mean():.3g}",
        ])
    header = ["fast path", "forwards / block", "14B TFLOP / block", "FLOP vs exact", "H200 bf16 bound ms (SP1)",
              "14B KV cache GB (SP1)", "14B KV read GB / block", "CPU forwards / block", "CPU DiT ms / block",
              "CPU DiT time vs exact", "median of the blocks' ratios", "latents max abs diff", "latents mean abs diff"]
    return format_table(header, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="mid", help="random weights of the CPU run")
    parser.add_argument("--blocks", type=int, default=CPU.blocks, help="blocks of each CPU session")
    parser.add_argument("--height", type=int, default=CPU.height)
    parser.add_argument("--width", type=int, default=CPU.width)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's); on a shared machine 1 "
                        "keeps a busy core from stalling every matrix product")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    w = dataclasses.replace(CPU, blocks=args.blocks, height=args.height, width=args.width)
    begin = time.perf_counter()
    runs = measure(args.preset, w, PATHS)
    print(f"CPU: {args.preset} preset (random weights), {w.height}x{w.width}, {w.dtype}, {w.blocks} blocks of "
          f"{BLOCK_FRAMES} latent frames, SP1, {torch.get_num_threads()} torch threads, the paths taking turns "
          f"block by block ({time.perf_counter() - begin:.0f} s); exact latents' mean abs "
          f"{np.abs(runs[0].latents).mean():.3g}. 14B: one full-window block at 480x832.")
    print(table(PATHS, base_settings(w), runs))


if __name__ == "__main__":
    main()
