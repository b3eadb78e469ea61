"""Peak host memory while loading the transformer shard by shard into the serving dtype.

    python -m bench.loading [--preset mid] [--dtype bfloat16]

Prints the transformer's size in the serving dtype, the checkpoint's size on disk (FP32), and the process's
peak RSS growth (VmHWM) while loading it onto the CPU: the loader never holds the FP32 state, so the growth
should stay near the serving-dtype size (goal: at most 1.3x).
"""
from __future__ import annotations

import argparse
import resource
from pathlib import Path

import torch

from backend.model.checkpoint import load_transformer
from backend.model.config import read_checkpoint_configs
from backend.model.dtypes import TORCH_DTYPES
from bench.common import ensure_checkpoint


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="mid")
    parser.add_argument("--checkpoint", type=Path)
    parser.add_argument("--dtype", choices=sorted(TORCH_DTYPES), default="bfloat16")
    args = parser.parse_args()
    root = ensure_checkpoint(args.checkpoint, args.preset)
    config = read_checkpoint_configs(str(root)).transformer
    on_disk = sum(p.stat().st_size for p in (root / "transformer").glob("*.safetensors"))
    torch.ones(1)  # torch's own allocations before the baseline
    before = current_rss_bytes()
    model = load_transformer(root / "transformer", config, TORCH_DTYPES[args.dtype], torch.device("cpu"))
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    growth = peak_rss_bytes() - before
    gib = 2**30
    print(f"| checkpoint | {root} ({config.num_layers} layers, dim {config.dim}) |")
    print(f"| on disk (FP32 shards) | {on_disk / gib:.2f} GiB |")
    print(f"| weights in {args.dtype} | {weights / gib:.2f} GiB |")
    print(f"| peak RSS growth while loading | {growth / gib:.2f} GiB ({growth / weights:.2f}x the {args.dtype} size) |")


if __name__ == "__main__":
    main()
