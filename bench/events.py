"""What a prompt event costs: the step latency of an event step against a plain step (direct engine, SP1, CPU),
and, from the config, the FLOP and bytes of rebuilding a session's prompt K/V at 14B per SP degree.

    python -m bench.events [--preset tiny] [--rounds 8]

One steered session on the direct engine (no decode). After warm-up blocks that fill the KV window, each round
runs three steps in turn: a plain step, an event with a prompt new to the cache (rank 0 encodes it), and an event
with a prompt the cache holds. A step's time is `set_prompt` (events) plus `run_block`; the table gives each
kind's median and its ratio to the plain step's, all from this one run.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

from backend.api.request import Controls
from backend.engine.blocks import BlockControls
from backend.engine.rollout import WorldModelEngine
from backend.model.config import TransformerConfig
from bench.common import GPU, TINY, add_workload_args, engine_settings, ensure_checkpoint, format_table, make_request, \
    workload_from_args
from bench.flops import block_keys, forward_flops

DENOISE_STEPS = 4  # plus the clean-KV commit: 5 forwards a block
BF16 = 2


def step_latencies(engine: WorldModelEngine, request, rounds: int, warmup: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"plain step": [], "event, prompt encoded": [], "event, prompt cached": []}
    step = Controls(keys="w")
    with engine.session(request) as session:
        for _ in range(warmup):
            engine.run_block([session], {session.id: BlockControls(step)})
        for r in range(rounds):
            for kind, prompt in (("plain step", None), ("event, prompt encoded", f"it starts to snow, take {r}"),
                                 ("event, prompt cached", request.prompt)):
                start = time.perf_counter()
                if prompt is not None:
                    engine.set_prompt(session, prompt)
                engine.run_block([session], {session.id: BlockControls(step)})
                times[kind].append((time.perf_counter() - start) * 1000.0)
    return times


def rebuild_rows(cfg: TransformerConfig, degrees: list[int]) -> list[list[str]]:
    """Per SP degree (TP 1): a prompt's K/V rebuild against one block's DiT, per rank."""
    d, rows = cfg.dim, []
    macs = cfg.text_len * cfg.num_layers * 2 * d * d  # k and v projections of every layer
    embed = cfg.text_len * (cfg.text_dim * d + d * d)  # text_embedding's two layers
    tokens = GPU.height // 16 * GPU.width // 16 * 3  # a block of 3 latent frames at 480x832
    keys = block_keys(GPU.window_frames, 3, GPU.window_frames, tokens // 3)
    block = forward_flops(cfg, tokens, keys).block(DENOISE_STEPS + 1)
    for sp in degrees:
        built = 2.0 * (macs + embed)  # every rank projects all heads, then keeps its shard (norm_k spans them)
        sharded = 2.0 * (macs / sp + embed)  # were k and v projected per head shard
        held = cfg.text_len * cfg.num_layers * 2 * d * BF16 / sp
        weights = cfg.num_layers * 2 * d * d * BF16
        rows.append([f"SP{sp}", f"{built / 1e12:.2f}", f"{sharded / 1e12:.2f}", f"{block / sp / 1e12:.0f}",
                     f"{built / (block / sp) * 100:.2f}%", f"{held / 2**20:.0f}", f"{weights / 2**30:.2f}"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--rounds", type=int, default=8, help="rounds of (plain, encoded event, cached event)")
    parser.add_argument("--warmup", type=int, default=4, help="blocks before timing (the window fills)")
    parser.add_argument("--sp", type=int, nargs="+", default=[1, 2, 4, 8], help="SP degrees of the 14B table")
    add_workload_args(parser, TINY, preset="tiny")
    args = parser.parse_args()
    w = workload_from_args(args)
    checkpoint = ensure_checkpoint(args.checkpoint, args.preset)
    engine = WorldModelEngine.load(engine_settings(checkpoint, w, sp=1))
    request = dataclasses.replace(make_request(w, decode=False), num_frames=None, poses=None, keys="w")
    times = step_latencies(engine, request, args.rounds, args.warmup)
    plain = statistics.median(times["plain step"])
    print(f"{args.preset} preset, {w.height}x{w.width}, {w.dtype}, SP1 on CPU, {args.rounds} rounds after "
          f"{args.warmup} warm-up blocks")
    print(format_table(["step", "median ms", "x plain"],
                       [[k, f"{statistics.median(v):.1f}", f"{statistics.median(v) / plain:.3f}"] for k, v in times.items()]))
    print("\n14B, 480x832, TP1: rebuilding one prompt's K/V against a block (5 forwards over the full window), per rank")
    print(format_table(["SP", "rebuild TFLOP", "if per shard", "block TFLOP", "rebuild / block", "K/V held MiB",
                        "k, v weights read GiB"], rebuild_rows(TransformerConfig.lingbot_14b(), args.sp)))


if __name__ == "__main__":
    main()
