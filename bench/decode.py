"""Per-block VAE decode, whole frames on one rank vs split by image rows across SP ranks (CPU, gloo), in one run.

Three ways to decode the same session's blocks of random latents with the same random-weight Wan VAE:
  whole, all cores      one process with every core's torch threads (an SP1 instance);
  whole, a rank's share one process with one SPn rank's share of the cores (an SPn owner with split_decode=false);
  split SPn             SPn processes, each with its share, decoding its band of rows (split_decode=true).
Each block's frames are compared with the whole decode's (max difference in gray levels).
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from diffusers import AutoencoderKLWan

from backend.model.tiny_checkpoint import PRESETS, vae_arguments
from backend.model.vae import StreamingVae
from backend.parallel.local import run_group
from backend.parallel.group import GroupHandles
from backend.serving.threads import instance_cores
from bench.common import format_table, use_stub_thread_environment

# The tiny presets' decoders, and the published Wan 2.1 VAE that LingBot-World v2 decodes with (diffusers' defaults).
ARCHITECTURES = {**{name: vae_arguments(preset) for name, preset in PRESETS.items()}, "wan": {}}
LATENT_FRAMES = 3  # one AR block


def decode_blocks(groups: GroupHandles, architecture: str, height: int, width: int, blocks: int, split: bool
                  ) -> tuple[list[float], list[np.ndarray]]:
    """(ms per block, frames per block on rank 0) for `blocks` blocks of one session."""
    torch.manual_seed(0)
    arguments = ARCHITECTURES[architecture]
    z = arguments.get("z_dim", 16)
    vae = AutoencoderKLWan(**arguments, latents_mean=[0.0] * z, latents_std=[1.0] * z).eval()
    streaming = StreamingVae(vae, torch.device("cpu"), groups.decode if split else None)
    state = streaming.new_decode_state()
    latents = torch.Generator().manual_seed(1)
    times, frames = [], []
    for _ in range(blocks):
        block = torch.randn(1, z, LATENT_FRAMES, height // 8, width // 8, generator=latents)
        start = time.perf_counter()
        out = streaming.decode_block(block, state)
        times.append((time.perf_counter() - start) * 1000)
        if out is not None:
            frames.append(out)
    return times, frames


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--vae", choices=sorted(ARCHITECTURES), default="mid",
                        help="decoder size: a tiny checkpoint preset's, or the published Wan VAE's ('wan')")
    parser.add_argument("--sp", type=int, default=2, help="ranks of the split")
    parser.add_argument("--height", type=int, default=240)
    parser.add_argument("--width", type=int, default=416)
    parser.add_argument("--blocks", type=int, default=3, help="AR blocks of 3 latent frames; the first is not timed")
    args = parser.parse_args()
    use_stub_thread_environment()
    all_cores, share = instance_cores(1), instance_cores(args.sp)
    job = (args.vae, args.height, args.width, args.blocks)
    print(f"VAE {args.vae}, {args.height}x{args.width}, {args.blocks} blocks; torch threads: whole {all_cores}, "
          f"a rank's share {share}, split {args.sp} x {share}", flush=True)
    runs = {
        f"whole, {all_cores} threads": run_group(1, decode_blocks, (*job, False), threads=all_cores)[0],
        f"whole, {share} thread{'s' * (share > 1)}": run_group(1, decode_blocks, (*job, False), threads=share)[0],
        f"split SP{args.sp}, {share} each": run_group(args.sp, decode_blocks, (*job, True), threads=share)[0],
    }
    names = list(runs)
    reference = runs[names[0]][1]
    base = names[1]  # the owner alone on a rank's share: what the split replaces

    def ms(name: str) -> float:
        return statistics.mean(runs[name][0][1:] or runs[name][0])

    rows = [
        ["decode per block after the first, mean (ms)"] + [f"{ms(n):.0f}" for n in names],
        ["first block (ms)"] + [f"{runs[n][0][0]:.0f}" for n in names],
        [f"speedup vs {base}"] + [f"{ms(base) / ms(n):.2f}x" for n in names],
        ["max difference vs whole (gray levels)"] + [
            str(max(int(np.abs(a.astype(np.int16) - b).max()) for a, b in zip(runs[n][1], reference))) for n in names],
    ]
    print()
    print(format_table(["per block"] + names, rows))


if __name__ == "__main__":
    main()
