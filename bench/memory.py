"""Memory per GPU of the 14B model and one session at each TP x SP grid (bf16, 480x832), from the manifest.

    python -m bench.memory [--window-frames 18] [--height 480] [--width 832]

Weights: the 1,421 tensors of tests/data/lingbot_v2_14b_transformer_keys.json, each counted at the shape a TP
rank holds (the module built for tp ranks on the meta device: its 1/tp of the split dim, or the whole tensor),
and checked against backend/model/memory.py's closed form. Caches: one session's self-attention window and prompt
K/V on num_heads / (tp x sp) heads; while a block runs, its camera modulation (every layer's 1 + scale and shift for
the rank's tokens and channels, made once a block: model/memory.camera_modulation_bytes). Rank 0 also holds the
umT5-XXL text encoder; every rank the Wan VAE.
"""
from __future__ import annotations

import argparse
import json
import math

import torch

from backend.model.config import TransformerConfig
from backend.model.memory import camera_modulation_bytes, self_cache_bytes, text_cache_bytes, weight_parameters
from backend.model.tensor_slices import TensorPart
from backend.model.transformer import LingBotTransformer
from backend.launch.paths import REPO_ROOT
from bench.common import format_table

MANIFEST = REPO_ROOT / "tests" / "data" / "lingbot_v2_14b_transformer_keys.json"
BF16 = 2
BLOCK_FRAMES = 3  # latent frames a block (the diffusers layout's; the official layout's 4 make it 4/3 larger)
GIB = 2**30
TEXT_ENCODER_GIB = 11.4e9 / GIB  # umT5-XXL encoder in bf16 (5.7 B parameters), rank 0 only
VAE_GIB = 0.5e9 / GIB  # Wan 2.1 VAE in float32 (127 M parameters), every rank (the decode is split)
REFERENCE_PEAK_GIB = 69.3  # the published reference at SP1 (H200, compiled, umT5 included; bench/README section 5)
HEADROOM_GIB = 1.5  # CUDA context, NCCL buffers, memory the driver reserves: a card of S GB holds S - 1.5 GiB here
LAYOUTS = [(1, 1), (1, 2), (1, 4), (1, 8), (2, 1), (2, 2), (2, 4), (4, 1), (4, 2), (8, 1)]
GPUS = [(16, "16 GB (T4, V100 16 GB)"), (24, "24 GB (L4, A10, RTX 4090)"), (32, "32 GB (V100 32 GB, RTX 5090)"),
        (40, "40 GB (A100 40 GB)"), (48, "48 GB (L40S, RTX 6000 Ada)"), (80, "80 GB (A100 / H100 80 GB)"),
        (141, "141 GB (H200)")]


def weight_bytes_from_manifest(cfg: TransformerConfig, tp: int) -> int:
    """bf16 bytes one TP rank holds: each manifest tensor at this rank's shape."""
    with torch.device("meta"):
        local = {k: list(v.shape) for k, v in LingBotTransformer(cfg, tp).state_dict().items()}
    manifest = json.loads(MANIFEST.read_text())
    if manifest.keys() != local.keys():
        raise SystemExit(f"{MANIFEST} and the module disagree on names")
    part = TensorPart(0, tp)
    total = 0
    for name, full in manifest.items():
        shape = list(full)
        dim = part.split_dim(name, full, local[name])
        if dim is not None:
            shape[dim] //= tp
        total += math.prod(shape) * BF16
    if total != weight_parameters(cfg, tp) * BF16:
        raise SystemExit(f"TP{tp}: the manifest gives {total} B, the formula {weight_parameters(cfg, tp) * BF16} B")
    return total


def smallest_gpu(gib: float) -> str:
    return next((name for size, name in GPUS if gib <= size - HEADROOM_GIB), "none listed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--window-frames", type=int, default=18)
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--width", type=int, default=832)
    args = parser.parse_args()
    cfg = TransformerConfig.lingbot_14b()
    tokens_per_frame = (args.height // 16) * (args.width // 16)
    window_tokens = args.window_frames * tokens_per_frame
    weights = {tp: weight_bytes_from_manifest(cfg, tp) / GIB for tp in sorted({tp for tp, _ in LAYOUTS})}
    # The reference's peak less what the rows count at SP1: activations, the decode's working memory, allocator
    # slack. Taken as the same on every rank and layout (activations shrink with sp: an upper bound).
    working = REFERENCE_PEAK_GIB - (weights[1] + (self_cache_bytes(cfg, window_tokens, 1, BF16)
                                                  + text_cache_bytes(cfg, 1, BF16)) / GIB + VAE_GIB + TEXT_ENCODER_GIB)
    rows = []
    for tp, sp in LAYOUTS:
        ranks = tp * sp
        kv = self_cache_bytes(cfg, window_tokens, ranks, BF16) / GIB
        text = text_cache_bytes(cfg, ranks, BF16) / GIB
        camera = camera_modulation_bytes(cfg, BLOCK_FRAMES * tokens_per_frame, sp, tp, BF16) / GIB
        others = weights[tp] + kv + text + camera + VAE_GIB + working
        rank0 = others + TEXT_ENCODER_GIB
        label = f"TP{tp} x SP{sp}"
        rows.append([label, str(ranks), f"{weights[tp]:.2f}", f"{kv:.2f}", f"{text:.3f}", f"{camera:.2f}", f"{rank0:.1f}",
                     f"{others:.1f}", smallest_gpu(rank0), smallest_gpu(others)])
    print(f"14B DiT ({sum(1 for _ in json.loads(MANIFEST.read_text()))} tensors), bf16, {args.height}x{args.width}, "
          f"window {args.window_frames} frames = {window_tokens:,} tokens; GiB per GPU; umT5 {TEXT_ENCODER_GIB:.1f} on "
          f"rank 0, VAE {VAE_GIB:.2f} and working memory {working:.1f} on every rank; a card of S GB holds "
          f"S - {HEADROOM_GIB} GiB")
    print(format_table(["layout", "GPUs", "DiT weights", "KV window", "text K/V", "camera modulation", "rank 0", "other ranks",
                        "smallest GPU, rank 0", "smallest GPU, other ranks"], rows, left=1))


if __name__ == "__main__":
    main()
