"""Per-block VAE decode, whole frames on one rank vs split by image rows across SP ranks (CPU, gloo), in one run.

Ways to decode the same session's blocks of random latents with the same random-weight Wan VAE:
  whole, all cores      one process with every core's torch threads (an SP1 instance);
  whole, a rank's share one process with one SPn rank's share of the cores (an SPn owner with split_decode=false);
  split SPn             SPn processes, each with its share, decoding its band of rows (split_decode=true).
Each block's frames are compared with the whole decode's (max difference in gray levels).
--default-kernels adds the whole decodes on torch's default CPU kernels (the path before backend/model/cpu_vae),
and the largest float difference of a whole-clip decode against the fast path's. --decoder tiny adds the tiny
decoder (decoder=tiny: TAEHV for Wan 2.1, random weights in taew2_1.pth's layout) on the same threads, decoding
16-channel latents of the same size; it is another model, so its frames are not compared. --profile prints where
a block's whole decode spends its time (torch.profiler, self CPU time per op), on each path the run times.
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, replace

import numpy as np
import torch
from diffusers import AutoencoderKLWan

from backend.model.tiny_checkpoint import PRESETS, vae_arguments
from backend.model.tiny_vae import LATENT_CHANNELS, StreamingTinyDecoder, load_tiny_decoder
from backend.model.tiny_vae_weights import write_weights
from backend.model.vae import StreamingVae
from backend.parallel.local import run_group
from backend.parallel.group import GroupHandles
from backend.serving.threads import instance_cores
from bench.common import BUILD_DIR, format_table, use_stub_thread_environment

# The tiny presets' decoders, and the published Wan 2.1 VAE that LingBot-World v2 decodes with (diffusers' defaults).
ARCHITECTURES = {**{name: vae_arguments(preset) for name, preset in PRESETS.items()}, "wan": {}}
LATENT_FRAMES = 3  # one AR block
TINY_WEIGHTS = BUILD_DIR / "tiny_decoder" / "taew2_1_random.pth"


@dataclass(frozen=True)
class Job:
    architecture: str
    height: int
    width: int
    blocks: int
    split: bool = False
    fast_cpu: bool = True  # False: torch's default kernels
    whole_clip: bool = False  # also decode the blocks as one clip (float frames to compare)
    tiny_decoder: str = ""  # the tiny decoder's weights: it decodes in the VAE's place


@dataclass
class Run:
    times_ms: list[float]  # per block
    frames: list[np.ndarray]  # per block, on rank 0
    clip: np.ndarray | None  # the whole clip decoded at once (float, [-1, 1]), when the job asks


def latent_blocks(z: int, job: Job) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(1, z, LATENT_FRAMES, job.height // 8, job.width // 8, generator=generator)
            for _ in range(job.blocks)]


def decode_blocks(groups: GroupHandles, job: Job) -> Run:
    """Rank 0's times and frames of `job.blocks` blocks of one session, and its float whole-clip decode."""
    cpu = torch.device("cpu")
    if job.tiny_decoder:
        streaming = StreamingTinyDecoder(load_tiny_decoder(job.tiny_decoder, cpu), cpu)
        blocks = latent_blocks(LATENT_CHANNELS, job)
        return Run(*timed(streaming, blocks), None)
    torch.manual_seed(0)
    arguments = ARCHITECTURES[job.architecture]
    z = arguments.get("z_dim", 16)
    vae = AutoencoderKLWan(**arguments, latents_mean=[0.0] * z, latents_std=[1.0] * z).eval()
    streaming = StreamingVae(vae, cpu, groups.decode if job.split else None, fast_cpu=job.fast_cpu)
    blocks = latent_blocks(z, job)
    times, frames = timed(streaming, blocks)
    clip = None
    if job.whole_clip:
        with torch.no_grad():
            clip = vae.decode(torch.cat(blocks, dim=2)).sample.numpy()  # numpy: a tensor would leave by fd
    return Run(times, frames, clip)


def profile_block(groups: GroupHandles, job: Job, rows: int = 6) -> list[tuple[str, float, float]]:
    """The ops taking the most self CPU time in one block's whole decode (after a first, untimed one):
    (op, ms, share of the block)."""
    from torch.profiler import ProfilerActivity, profile

    cpu = torch.device("cpu")
    if job.tiny_decoder:
        streaming, z = StreamingTinyDecoder(load_tiny_decoder(job.tiny_decoder, cpu), cpu), LATENT_CHANNELS
    else:
        torch.manual_seed(0)
        arguments = ARCHITECTURES[job.architecture]
        z = arguments.get("z_dim", 16)
        vae = AutoencoderKLWan(**arguments, latents_mean=[0.0] * z, latents_std=[1.0] * z).eval()
        streaming = StreamingVae(vae, cpu, fast_cpu=job.fast_cpu)
    first, second = latent_blocks(z, replace(job, blocks=2))
    state = streaming.new_decode_state()
    streaming.decode_block(first, state)
    with profile(activities=[ProfilerActivity.CPU]) as recorded:
        streaming.decode_block(second, state)
    events = sorted(recorded.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    return [(e.key, e.self_cpu_time_total / 1000, e.self_cpu_time_total / total) for e in events[:rows]]


def timed(streaming: StreamingVae | StreamingTinyDecoder, blocks: list[torch.Tensor]
          ) -> tuple[list[float], list[np.ndarray]]:
    """One session's blocks decoded in order: ms per block, and the frames that came back here."""
    state = streaming.new_decode_state()
    times, frames = [], []
    for block in blocks:
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
    parser.add_argument("--default-kernels", action="store_true",
                        help="also decode whole frames on torch's default CPU kernels (before cpu_vae)")
    parser.add_argument("--decoder", choices=("vae", "tiny"), default="vae",
                        help="tiny: also time the tiny decoder (random weights in taew2_1.pth's layout, written to "
                             f"{TINY_WEIGHTS.relative_to(BUILD_DIR.parent)}) on the same threads")
    parser.add_argument("--profile", action="store_true",
                        help="print the ops a block's whole decode spends its time in, on a rank's share")
    args = parser.parse_args()
    use_stub_thread_environment()
    all_cores, share = instance_cores(1), instance_cores(args.sp)
    job = Job(args.vae, args.height, args.width, args.blocks, whole_clip=args.default_kernels)
    print(f"VAE {args.vae}, {args.height}x{args.width}, {args.blocks} blocks; torch threads: whole {all_cores}, "
          f"a rank's share {share}, split {args.sp} x {share}", flush=True)
    whole_all, whole_share = f"whole, {all_cores} threads", f"whole, {share} thread{'s' * (share > 1)}"
    runs: dict[str, Run] = {}
    plain = replace(job, whole_clip=False)
    ways = [(whole_all, 1, job, all_cores), (whole_share, 1, plain, share)]
    if args.default_kernels:
        ways += [(f"{whole_all}, default kernels", 1, replace(job, fast_cpu=False), all_cores),
                 (f"{whole_share}, default kernels", 1, replace(plain, fast_cpu=False), share)]
    ways.append((f"split SP{args.sp}, {share} each", args.sp, replace(plain, split=True), share))
    tiny_names = []
    if args.decoder == "tiny":
        tiny = replace(plain, tiny_decoder=str(write_weights(TINY_WEIGHTS)))
        tiny_names = [f"tiny, {all_cores} threads", f"tiny, {share} thread{'s' * (share > 1)}"]
        ways += [(tiny_names[0], 1, tiny, all_cores), (tiny_names[1], 1, tiny, share)]
    for name, ranks, way, threads in ways:
        runs[name] = run_group(ranks, decode_blocks, (way,), threads=threads)[0]
    names = list(runs)
    reference = runs[whole_all].frames
    base = names[1]  # the owner alone on a rank's share: what the split replaces

    def ms(name: str) -> float:
        return statistics.mean(runs[name].times_ms[1:] or runs[name].times_ms)

    def gray_diff(name: str) -> str:
        if name in tiny_names:
            return "-"  # another model
        return str(max(int(np.abs(a.astype(np.int16) - b).max()) for a, b in zip(runs[name].frames, reference)))

    rows = [
        ["decode per block after the first, mean (ms)"] + [f"{ms(n):.0f}" for n in names],
        ["first block (ms)"] + [f"{runs[n].times_ms[0]:.0f}" for n in names],
        [f"speedup vs {base}"] + [f"{ms(base) / ms(n):.2f}x" for n in names],
        ["frames per block"] + [", ".join(str(len(f)) for f in runs[n].frames) for n in names],
        [f"max difference vs {whole_all} (gray levels)"] + [gray_diff(n) for n in names],
    ]
    print()
    print(format_table(["per block"] + names, rows))
    for tiny_name, vae_name in zip(tiny_names, (whole_all, whole_share)):
        print(f"\n{tiny_name}: {ms(tiny_name):.0f} ms a block against the VAE's {ms(vae_name):.0f} ms on the same "
              f"threads: {ms(tiny_name) / ms(vae_name):.2f} of its time")
    if args.profile:
        for name, _, way, threads in ways:
            if way.split or threads != share:
                continue
            print(f"\nwhere one block's time goes, {name} (self CPU time, torch.profiler):\n")
            top = run_group(1, profile_block, (way,), threads=threads)[0]
            print(format_table(["op", "ms", "share"], [[op, f"{t:.0f}", f"{p:.0%}"] for op, t, p in top]))
    if args.default_kernels:
        fast, slow = runs[whole_all].clip, runs[f"{whole_all}, default kernels"].clip
        changed = np.mean([np.mean(a != b) for a, b in zip(runs[f"{whole_all}, default kernels"].frames, reference)])
        print(f"\nfast path vs default kernels, whole clip of {fast.shape[2]} frames: max abs difference "
              f"{np.abs(fast - slow).max():.2e} (values in [-1, 1], largest |value| {np.abs(slow).max():.2f}); "
              f"gray levels changed by rounding: {changed:.2e} of the values")


if __name__ == "__main__":
    main()
