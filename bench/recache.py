"""What a recache costs and what it changes: `engine.recache` after a prompt event recomputes the self-attention
K/V of every cached frame under the new prompt (docs/model.md, Recache).

    python -m bench.recache [--preset mid] [--blocks 7] [--recache-after 1 2 7] [--effect-preset tiny] [--event-blocks 2 5]

1. Cost on CPU (SP1, random weights made in memory, `--preset`, 64x64, window 18, sink 6): one session with
   keep_commits; after `--recache-after` blocks (each) a prompt event (`set_prompt`) and a recache. Each row gives
   the wall time of the block just run and of the recache beside it, from the same run.
2. Cost at the 14B geometry (480x832, 3-frame blocks, window 18, sink 6) from bench/flops' FLOP model: a recache
   after n blocks runs one forward per kept block, each over the replayed history so far; the next block runs 5
   forwards over its window. The kept records' bytes per session beside them.
3. Effect (`--effect-preset` checkpoint with its text encoder, so prompts differ; the tests' 9-frame window and
   3-frame sink): an `--effect-blocks` session whose prompt changes before block k, with and without a recache,
   against the teacher-forced ground truth: the same session with every commit under the new prompt (its first
   k blocks commit the event run's latents). The max and mean abs distance of each later block's latents.
"""
from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from backend.api.request import SessionRequest
from backend.engine.rollout import WorldModelEngine
from backend.engine.session import Session
from backend.model.config import TransformerConfig
from backend.model.dtypes import torch_dtype
from backend.model.kv_cache import SelfAttentionCache
from backend.model.memory import commit_record_bytes
from backend.model.tiny_checkpoint import PRESETS
from bench.common import GPU, TINY, Workload, engine_settings, ensure_checkpoint, format_table, make_request
from bench.flops import block_keys, forward_flops
from bench import gpu_random_weights

EVENT_PROMPTS = ("it starts to snow", "heavy rain falls")
DENOISE_STEPS = 4  # plus the clean-KV commit: 5 forwards a block
VAE_FACTOR = 8  # pixels per latent pixel, each way (the Wan VAE)
# The cost run: the mid preset's window and sink at the size bench.engine runs it on CPU.
COST = Workload(height=64, width=64, blocks=7, dtype="float32", window_frames=18, sink_frames=6)


# ---------------------------------------------------------------- a session around a prompt event (the tests use these)


@dataclass
class EventRun:
    """One session's blocks around a prompt event, and its cache as the event (and recache) left it."""

    latents: list[np.ndarray]  # each block's [1, z, block_frames, h, w]
    keys: list[np.ndarray]  # each layer's cached K [1, length, local heads, head_dim] before the event's block
    values: list[np.ndarray]
    length: int  # the cache's committed tokens then
    evicted_tokens: int
    kept_blocks: int  # the commit records the session held then (0 without keep_commits)


def event_rollout(engine: WorldModelEngine, request: SessionRequest, blocks: int, at: int, prompt: str | None = None,
                  recache: bool = False, teacher: Sequence[np.ndarray] = ()) -> EventRun:
    """`blocks` blocks of one session; before block `at` (< blocks) the prompt event `prompt` (None: none), then a
    recache if asked, then a snapshot of the cache. Block i < len(teacher) commits teacher[i] in place of its own latents.
    Every rank of a group calls it alike."""
    with engine.session(request, keep_commits=recache) as session:
        latents = []
        for index in range(blocks):
            if index == at:
                if prompt is not None:
                    engine.set_prompt(session, prompt)
                if recache:
                    engine.recache(session)
                snapshot = _snapshot(session)
            forced = {session.id: torch.from_numpy(teacher[index])} if index < len(teacher) else None
            (out,) = engine.run_block([session], teacher=forced)
            latents.append(out.latents.numpy())
    return EventRun(latents, *snapshot)


def ground_truth(engine: WorldModelEngine, request: SessionRequest, blocks: int, at: int, prompt: str,
                 event: EventRun) -> EventRun:
    """The session whose commits were all under `prompt`: its first `at` blocks commit the event run's latents
    (teacher-forced), the rest run as usual; its snapshot is taken before block `at`, as the event run's."""
    return event_rollout(engine, dataclasses.replace(request, prompt=prompt), blocks, at, teacher=event.latents[:at])


def _snapshot(session: Session) -> tuple[list[np.ndarray], list[np.ndarray], int, int, int]:
    cache, n = session.cache, session.cache.length
    copy = lambda buffers: [b[:, :n].float().numpy().copy() for b in buffers]  # noqa: E731
    return copy(cache.keys), copy(cache.values), n, cache.evicted_tokens, len(session.commits or ())


# ---------------------------------------------------------------- 1. cost on CPU


def cost_rows(engine: WorldModelEngine, request: SessionRequest, recache_after: set[int]) -> list[list[str]]:
    """After each of `recache_after` blocks: the kept blocks, the last block's run_block ms, the recache's ms and
    its ratio to the block."""
    rows = []
    with engine.session(request, keep_commits=True) as session:
        while not session.done:
            block_ms = _ms(lambda: engine.run_block([session]))
            if session.block_index in recache_after:
                engine.set_prompt(session, EVENT_PROMPTS[len(rows) % 2])
                recache_ms = _ms(lambda: engine.recache(session))
                rows.append([str(session.block_index), str(len(session.commits)), f"{block_ms:.1f}",
                             f"{recache_ms:.1f}", f"{recache_ms / block_ms:.2f}"])
    return rows


def _ms(run) -> float:
    start = time.perf_counter()
    run()
    return (time.perf_counter() - start) * 1000.0


def random_engine(preset: str, w: Workload) -> WorldModelEngine:
    """SP1 on CPU with random weights made in memory (bench.gpu --random-weights' builders)."""
    transformer, vae = gpu_random_weights.model_configs(preset)
    parts = gpu_random_weights.build_parts(transformer, vae, torch_dtype(w.dtype), torch.device("cpu"), w.seed)
    return gpu_random_weights.build_engine(gpu_random_weights.engine_settings(w, "cpu", False), transformer, vae, parts)


# ---------------------------------------------------------------- 2. cost at the 14B geometry


def kept_blocks(blocks: int, block_frames: int, window_frames: int, sink_frames: int) -> int:
    """Blocks whose tokens a session's cache still holds after `blocks` commits (one token per frame)."""
    cache = SelfAttentionCache(1, window_frames, block_frames, sink_frames, 1, 1, torch.float32, torch.device("cpu"))
    for _ in range(blocks):
        cache.make_room()
        cache.commit()
    return sum(cache.evicted_among(i * block_frames, block_frames) < block_frames for i in range(blocks))


def flop_rows(cfg: TransformerConfig, w: Workload, blocks: int, block_frames: int = 3) -> list[list[str]]:
    """After n blocks: the recache's forwards and TFLOP, the next block's (5 forwards), the records' bytes."""
    latent_h, latent_w = w.height // VAE_FACTOR, w.width // VAE_FACTOR
    tokens_per_frame = latent_h // cfg.patch_size[1] * latent_w // cfg.patch_size[2]
    tokens = block_frames * tokens_per_frame
    record = commit_record_bytes(cfg.out_dim, block_frames, latent_h, latent_w)
    rows = []
    for n in range(1, blocks + 1):
        kept = kept_blocks(n, block_frames, w.window_frames, w.sink_frames)
        recache = sum(forward_flops(cfg, tokens, block_keys(i, block_frames, w.window_frames, tokens_per_frame)).total
                      for i in range(kept))
        block = forward_flops(cfg, tokens, block_keys(n, block_frames, w.window_frames, tokens_per_frame)).block(
            DENOISE_STEPS + 1)
        rows.append([str(n), str(kept), f"{recache / 1e12:.0f}", f"{block / 1e12:.0f}", f"{recache / block:.2f}",
                     f"{kept * record:,}"])
    return rows


# ---------------------------------------------------------------- 3. effect against the ground truth


def effect_rows(engine: WorldModelEngine, request: SessionRequest, blocks: int, at: int) -> list[list[str]]:
    """Each block from `at` on: max and mean abs distance to the ground truth, without and with a recache."""
    prompt = EVENT_PROMPTS[0]
    plain = event_rollout(engine, request, blocks, at, prompt)
    recached = event_rollout(engine, request, blocks, at, prompt, recache=True)
    truth = ground_truth(engine, request, blocks, at, prompt, recached)
    rows = []
    for index in range(at, blocks):
        cells = []
        for run in (plain, recached):
            diff = np.abs(run.latents[index] - truth.latents[index])
            cells += [f"{diff.max():.3g}", f"{diff.mean():.3g}"]
        rows.append([str(index), *cells])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="mid", help="random weights of the cost run")
    parser.add_argument("--blocks", type=int, default=COST.blocks, help="blocks of the cost run")
    parser.add_argument("--recache-after", type=int, nargs="+", default=[1, 2, COST.blocks],
                        help="the cost run's recaches: after these many blocks")
    parser.add_argument("--effect-preset", choices=sorted(PRESETS), default="tiny", help="checkpoint of the effect run")
    parser.add_argument("--effect-blocks", type=int, default=8)
    parser.add_argument("--event-blocks", type=int, nargs="+", default=[2, 5], help="the blocks an event precedes")
    args = parser.parse_args()

    cost = dataclasses.replace(COST, blocks=args.blocks)
    engine = random_engine(args.preset, cost)
    begin = time.perf_counter()
    rows = cost_rows(engine, make_request(cost, decode=False), set(args.recache_after))
    print(f"1. {args.preset} preset (random weights), {cost.height}x{cost.width}, {cost.dtype}, window "
          f"{cost.window_frames}, sink {cost.sink_frames}, SP1 on CPU ({time.perf_counter() - begin:.0f} s)")
    print(format_table(["blocks run", "kept blocks = forwards", "last block ms", "recache ms", "recache / block"], rows))

    print(f"\n2. 14B, {GPU.height}x{GPU.width}, 3-frame blocks, window {GPU.window_frames}, sink {GPU.sink_frames}: a "
          "recache after n blocks against the next block (5 forwards), and the records kept per session (every rank)")
    print(format_table(["blocks run", "kept blocks = forwards", "recache TFLOP", "next block TFLOP",
                        "recache / block", "records kept (B)"], flop_rows(TransformerConfig.lingbot_14b(), GPU, 8)))

    effect = dataclasses.replace(TINY, blocks=args.effect_blocks)
    engine = WorldModelEngine.load(engine_settings(ensure_checkpoint(None, args.effect_preset), effect, sp=1))
    request = make_request(effect, decode=False)
    for at in args.event_blocks:
        print(f"\n3. {args.effect_preset} preset, {effect.height}x{effect.width}, {effect.dtype}, window "
              f"{effect.window_frames}, sink {effect.sink_frames}: an event before block {at} of {effect.blocks}, "
              "latents' abs distance to the teacher-forced ground truth")
        print(format_table(["block", "no recache max", "no recache mean", "recache max", "recache mean"],
                           effect_rows(engine, request, effect.blocks, at)))


if __name__ == "__main__":
    main()
