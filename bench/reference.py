"""The project's DiT forward against the reference's own `WanModelFast` (robbyant/lingbot-world-v2) on the same
random weights and inputs, on CPU; and the project's blocks compiled (torch.compile, inductor) against eager.

    git --git-dir=MIRROR archive HEAD wan | tar -x -C /tmp/lingbot-ref      # a checkout of the reference's wan/
    python -m bench.reference --reference /tmp/lingbot-ref [--preset mid] [--blocks 8] [--no-compile] \
        [--camera-each-forward]

Every forward of a session of `--blocks` blocks (4 DMD timesteps, then the commit at t = 0, 5 forwards a block)
runs on each side with the same inputs (noise, condition, camera, prompt states drawn from `--seed`) and its own
KV cache: the reference's dict caches (its own rolling and sink), the project's SelfAttentionCache. The sides take
turns call by call (another side first each time), so the machine's load falls alike on them. Each forward is
called `--repeats` times on each side (the same inputs write the same K/V into the same slot, on both sides) and
its time is the least of its calls' wall times. Blocks 0 and 1 are left out of the ratios: the reference projects
the prompt's K/V in its first forward (the project before it), and the compiled side makes its graphs there (for
an empty cache, then with the cache length dynamic; each for the first layer's input, a view, and for the
others'). Distances: max abs difference of each forward's output, over every forward.

The reference is imported from `--reference` at run time; nothing of it is in this project. It needs `einops`
(a dependency of the reference, not of the project: `pip install einops`). Two stubs, set before any forward:
* `wan` and `wan.modules` are empty packages on the checkout's directories, so their `__init__`s (which import
  the whole pipeline: T5, VAE, image2video) do not run; only `wan.modules.model_fast` and what it imports load.
* its attention functions (`attention`, `flash_attention` in model_fast's namespace: flash-attn, CUDA only) are
  routed to torch SDPA in the inputs' dtype (the project's `sdpa_attention`), so both sides run the same kernel.
  The reference's own SDPA fallback would cast float32 to bfloat16 first.
Weights: `WanModelFast`'s state dict has the project's names one for one (the project loads the published
checkpoint under its own names); the reference's model, built on the meta device, takes the project's tensors
themselves (strict, assign).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import statistics
import sys
import time
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from backend.model.attention import sdpa_attention
from backend.model.condition import condition_mask
from backend.model.config import TransformerConfig
from backend.model.kv_cache import SelfAttentionCache
from backend.model.random_weights import random_transformer
from backend.model.rope import rope_tables
from backend.model.schedule import dmd_schedule
from backend.model.tiny_checkpoint import PRESETS, transformer_config
from backend.model.transformer import ForwardContext, LingBotTransformer
from backend.parallel.sequence import SequenceParallel
from bench.common import format_table

BLOCK_FRAMES = 3
DMD_INDICES = (0, 250, 500, 750)
PROMPT_TOKENS = 24  # the prompt's real tokens before zero-padding to text_len
Forward = Callable[[int, "ForwardInputs"], torch.Tensor]  # (block index, inputs) -> velocity [16, F, h, w]


@dataclass(frozen=True)
class ForwardInputs:
    x: torch.Tensor  # [1, 16, F, h, w] noisy latents
    y: torch.Tensor  # [1, 20, F, h, w] mask + condition latents
    camera: torch.Tensor  # [1, 384, F, h, w] camera features, one tensor for a block's forwards
    t: float
    step: int  # the forward's place in its block: 0-3 the DMD steps, 4 the commit


@dataclass(frozen=True)
class Geometry:
    latent_h: int
    latent_w: int
    window_frames: int
    sink_frames: int

    def tokens_per_frame(self, cfg: TransformerConfig) -> int:
        return self.latent_h // cfg.patch_size[1] * self.latent_w // cfg.patch_size[2]


# ---------------------------------------------------------------- the reference, imported from its checkout


def import_reference(root: Path) -> types.ModuleType:
    """`wan.modules.model_fast` from a checkout, its package `__init__`s skipped, its attention routed to SDPA."""
    for name, path in (("wan", root / "wan"), ("wan.modules", root / "wan" / "modules")):
        if not path.is_dir():
            raise SystemExit(f"error: --reference {root}: no directory {path} (a checkout of robbyant/lingbot-world-v2)")
        package = types.ModuleType(name)
        package.__path__ = [str(path)]
        sys.modules[name] = package
    try:
        model_fast = importlib.import_module("wan.modules.model_fast")
    except ModuleNotFoundError as exc:
        raise SystemExit(f"error: the reference needs {exc.name!r} (pip install {exc.name})") from exc
    model_fast.attention = model_fast.flash_attention = reference_attention
    # Its CUDA autocast regions are inert on CPU (float32 throughout); torch warns at each one.
    warnings.filterwarnings("ignore", message="CUDA is not available or torch_xla is imported")
    return model_fast


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_lens: torch.Tensor | None = None,
                        k_lens: torch.Tensor | None = None, **_flash_options: object) -> torch.Tensor:
    """The reference's `attention` / `flash_attention` as model_fast calls them (no lengths: all rows), by SDPA."""
    if q_lens is not None or k_lens is not None:
        raise ValueError("the stub attends over every row; the reference passed lengths")
    return sdpa_attention(q, k, v)


def reference_model(model_fast: types.ModuleType, cfg: TransformerConfig, g: Geometry,
                    ours: LingBotTransformer) -> torch.nn.Module:
    """`WanModelFast` of `cfg` on the project's tensors, built on the meta device (no weights of its own). Its RoPE
    table (a plain attribute its __init__ computes) comes from a one-head model of the same head_dim on CPU."""
    arguments = dict(model_type="i2v", patch_size=cfg.patch_size, text_len=cfg.text_len, in_dim=cfg.in_dim,
                     dim=cfg.dim, ffn_dim=cfg.ffn_dim, freq_dim=cfg.freq_dim, text_dim=cfg.text_dim,
                     out_dim=cfg.out_dim, num_heads=cfg.num_heads, num_layers=cfg.num_layers,
                     local_attn_size=g.window_frames, sink_size=g.sink_frames, qk_norm=cfg.qk_norm,
                     cross_attn_norm=cfg.cross_attn_norm, eps=cfg.eps)
    with torch.device("meta"):
        model = model_fast.WanModelFast(**arguments)
    one_head = arguments | dict(dim=cfg.head_dim, ffn_dim=cfg.head_dim, num_heads=1, num_layers=1, text_dim=8,
                                freq_dim=8, text_len=1)
    model.freqs = model_fast.WanModelFast(**one_head).freqs
    model.load_state_dict(ours.state_dict(), strict=True, assign=True)
    return model.eval().requires_grad_(False)


def reference_forward(model: torch.nn.Module, cfg: TransformerConfig, g: Geometry, states: torch.Tensor) -> Forward:
    """The reference's forward with its own caches, called as wan/image2video.py's causal loop calls it."""
    tpf = g.tokens_per_frame(cfg)
    kv_size, heads, head_dim = g.window_frames * tpf, cfg.num_heads, cfg.dim // cfg.num_heads
    zeros = lambda rows: torch.zeros(1, rows, heads, head_dim)  # noqa: E731
    self_kv = [{"k": zeros(kv_size), "v": zeros(kv_size), "global_end_index": torch.tensor([0]),
                "local_end_index": torch.tensor([0])} for _ in range(cfg.num_layers)]
    cross_kv = [{"k": zeros(cfg.text_len), "v": zeros(cfg.text_len), "is_init": torch.tensor(0, dtype=torch.int32)}
                for _ in range(cfg.num_layers)]
    first = [True]

    def forward(block: int, inputs: ForwardInputs) -> torch.Tensor:
        out = model(x=[inputs.x[0]], t=torch.tensor([inputs.t]), context=[states[0]], seq_len=BLOCK_FRAMES * tpf,
                    y=[inputs.y[0]], dit_cond_dict={"c2ws_plucker_emb": inputs.camera.chunk(1, dim=0)},
                    kv_cache=self_kv, crossattn_cache=cross_kv, current_start=block * BLOCK_FRAMES * tpf,
                    max_attention_size=kv_size, frame_seqlen=tpf, cross_attn_first_call=first[0])[0]
        first[0] = False
        return out

    return forward


# ---------------------------------------------------------------- the project's forward


def project_forward(model: LingBotTransformer, cfg: TransformerConfig, g: Geometry, states: torch.Tensor,
                    camera_once: bool = True) -> Forward:
    """The project's forward as the engine runs it: its SelfAttentionCache (at a block's first forward: commit the
    block before, make room), the prompt's K/V projected once, one ForwardContext for a block's forwards (made in
    its first forward, whose call makes the block's camera modulation: every call of it, so that the least of
    its repeats counts that work too). camera_once=False: a context per forward, so each forward makes the camera
    modulation again, as the reference does (the project before it ran the camera branch once a block). A forward
    called again on the same inputs writes the same K/V into the same slot, as the reference's does."""
    tpf = g.tokens_per_frame(cfg)
    grid = (g.latent_h // cfg.patch_size[1], g.latent_w // cfg.patch_size[2])
    cache = SelfAttentionCache(cfg.num_layers, g.window_frames * tpf, BLOCK_FRAMES * tpf, g.sink_frames * tpf,
                               cfg.num_heads, cfg.head_dim, torch.float32, torch.device("cpu"))
    text = model.text_caches(states, slice(None))
    sp = SequenceParallel()
    current = [-1]  # the block whose K/V the cache's slot holds
    contexts: dict[int, ForwardContext] = {}  # the current block's, made at its first forward

    def forward(block: int, inputs: ForwardInputs) -> torch.Tensor:
        if block != current[0]:  # a new block: keep the last one's K/V, then make room
            if current[0] >= 0:
                cache.commit()
            cache.make_room()
            current[0] = block
        if inputs.step == 0 or not camera_once:  # a new context: its first forward makes the camera modulation
            cos, sin = rope_tables(cfg.head_dim, block * BLOCK_FRAMES, BLOCK_FRAMES, *grid)
            contexts.clear()
            contexts[block] = ForwardContext(sp=sp, attention=sdpa_attention, rope_cos=cos[None], rope_sin=sin[None],
                                             self_caches=[cache], text_caches=[text])
        latents = torch.cat([inputs.x, inputs.y], dim=1)
        timesteps = torch.full((1, BLOCK_FRAMES), inputs.t)
        return model(latents, inputs.camera, timesteps, tpf, contexts[block])[0]

    return forward


def shared_copy(model: LingBotTransformer) -> LingBotTransformer:
    """Another LingBotTransformer on the same tensors (to compile it while the first stays eager)."""
    with torch.device("meta"):
        twin = LingBotTransformer(model.config)
    twin.load_state_dict(model.state_dict(), strict=True, assign=True)
    return twin.eval().requires_grad_(False)


# ---------------------------------------------------------------- the run


def session_inputs(cfg: TransformerConfig, g: Geometry, blocks: int, seed: int) -> list[list[ForwardInputs]]:
    """Each block's forwards: the 4 DMD timesteps, then the commit at t = 0."""
    generator = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(shape, generator=generator)  # noqa: E731
    timesteps = [float(t) for t in dmd_schedule(5.0, DMD_INDICES).timesteps] + [0.0]
    z = cfg.out_dim
    inputs = []
    for block in range(blocks):
        mask = condition_mask(block * BLOCK_FRAMES, BLOCK_FRAMES, g.latent_h, g.latent_w, torch.device("cpu"))
        y = torch.cat([mask, rand(1, z, BLOCK_FRAMES, g.latent_h, g.latent_w)], dim=1)
        camera = rand(1, cfg.camera_channels, BLOCK_FRAMES, g.latent_h, g.latent_w)
        inputs.append([ForwardInputs(rand(1, z, BLOCK_FRAMES, g.latent_h, g.latent_w), y, camera, t, step)
                       for step, t in enumerate(timesteps)])
    return inputs


@dataclass
class SideRun:
    block_ms: list[float] = dataclasses.field(default_factory=list)  # per block: its forwards' least wall time
    first_calls_ms: list[float] = dataclasses.field(default_factory=list)  # per block: its forwards' first calls
    outputs: list[torch.Tensor] = dataclasses.field(default_factory=list)  # every forward's output


def run_sides(sides: dict[str, Forward], inputs: list[list[ForwardInputs]], repeats: int) -> dict[str, SideRun]:
    """Every forward `repeats` times on each side, the sides taking turns call by call (another side first each
    time); a side's time for a forward is the least of its repeats (what the machine's load spared)."""
    runs = {name: SideRun() for name in sides}
    names = list(sides)
    turn = 0
    for block, forwards in enumerate(inputs):
        for run in runs.values():
            run.block_ms.append(0.0)
            run.first_calls_ms.append(0.0)
        for step in forwards:
            calls: dict[str, list[float]] = {name: [] for name in names}
            outputs = {}
            for _ in range(repeats):
                for name in names[turn % len(names):] + names[: turn % len(names)]:
                    start = time.perf_counter()
                    with torch.no_grad():
                        outputs[name] = sides[name](block, step)
                    calls[name].append((time.perf_counter() - start) * 1000.0)
                turn += 1
            for name in names:
                runs[name].block_ms[-1] += min(calls[name])
                runs[name].first_calls_ms[-1] += calls[name][0]
                runs[name].outputs.append(outputs[name])
        print(f"block {block}: " + ", ".join(f"{n} {runs[n].block_ms[-1]:.0f} ms" for n in names), flush=True)
    return runs


def max_distance(a: SideRun, b: SideRun) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a.outputs, b.outputs))


STEADY_FROM = 2  # the first block of the ratios


def steady_ms(run: SideRun) -> float:
    return statistics.fmean(run.block_ms[STEADY_FROM:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--reference", type=Path, help="a checkout of robbyant/lingbot-world-v2 (its wan/); "
                        "without it only eager against compiled")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="mid", help="random weights")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--height", type=int, default=64, help="video pixels (latents: / 8)")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--no-compile", action="store_true", help="leave out the compiled side")
    parser.add_argument("--camera-each-forward", action="store_true",
                        help="add the project's eager forward with the camera branch in every forward (as the "
                        "reference runs it; the project before it ran once a block): what running it once saves")
    parser.add_argument("--repeats", type=int, default=3, help="calls of each forward per side; the least time counts")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's); on a shared machine 1 "
                        "keeps a busy core from stalling every matrix product")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.blocks <= STEADY_FROM:
        raise SystemExit(f"error: --blocks must be more than {STEADY_FROM} (blocks 0 and 1 are left out of the ratios)")

    cfg = transformer_config(PRESETS[args.preset])
    g = Geometry(args.height // 8, args.width // 8, cfg.local_attn_size, cfg.sink_size)
    model_fast = import_reference(args.reference) if args.reference is not None else None
    ours = random_transformer(cfg, torch.float32, torch.device("cpu"), args.seed)
    prompt_shape = (1, min(PROMPT_TOKENS, cfg.text_len), cfg.text_dim)
    states = torch.randn(prompt_shape, generator=torch.Generator().manual_seed(args.seed + 1))
    sides: dict[str, Forward] = {"project eager": project_forward(ours, cfg, g, states)}
    if args.camera_each_forward:
        sides["project eager, camera in every forward"] = project_forward(ours, cfg, g, states, camera_once=False)
    if model_fast is not None:
        sides["reference eager"] = reference_forward(reference_model(model_fast, cfg, g, ours), cfg, g, states)
    if not args.no_compile:
        compiled = shared_copy(ours)
        compiled.compile_blocks()
        sides["project compiled"] = project_forward(compiled, cfg, g, states)
    print(f"{args.preset} preset (random weights), {args.height}x{args.width}, float32, window {g.window_frames}, "
          f"sink {g.sink_frames}, {args.blocks} blocks x 5 forwards, each the least of {args.repeats} calls, "
          f"{torch.get_num_threads()} torch threads, "
          f"torch {torch.__version__}", flush=True)
    begin = time.perf_counter()
    runs = run_sides(sides, session_inputs(cfg, g, args.blocks, args.seed + 2), args.repeats)
    print(f"({time.perf_counter() - begin:.0f} s)\n")

    eager = runs["project eager"]
    rows = [[name, f"{run.first_calls_ms[0]:,.0f}", f"{run.first_calls_ms[1]:,.0f}", f"{steady_ms(run):,.0f}",
             f"{max_distance(run, eager):.3g}"] for name, run in runs.items()]
    print(format_table(["side", "block 0 ms, first calls", "block 1 ms, first calls",
                        f"mean block ms (blocks {STEADY_FROM}+, least of the calls)", "max abs diff vs project eager"],
                       rows))
    print()
    pairs = [("project eager", "reference eager"), ("project compiled", "reference eager"),
             ("project compiled", "project eager"), ("project eager", "project eager, camera in every forward"),
             ("project eager, camera in every forward", "reference eager")]
    ratios = [[f"{a} / {b}", f"{steady_ms(runs[a]) / steady_ms(runs[b]):.2f}",
               f"{statistics.median(x / y for x, y in zip(runs[a].block_ms[STEADY_FROM:], runs[b].block_ms[STEADY_FROM:])):.2f}"]
              for a, b in pairs if a in runs and b in runs]
    print(format_table([f"time ratio (blocks {STEADY_FROM}+)", "of the mean blocks", "median of the blocks' ratios"],
                       ratios))


if __name__ == "__main__":
    main()
