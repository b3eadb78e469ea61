"""Peak host memory while loading a part tensor by tensor into the serving dtype.

    python -m bench.loading [--preset mid] [--dtype bfloat16]          # the transformer's safetensors shards
    python -m bench.loading --part vae [--dtype float32]                # the official Wan2.1_VAE.pth
    python -m bench.loading --part text_encoder [--dtype bfloat16]      # an official umT5 .pth (bf16)

Prints the part's size in the serving dtype, its size on disk, and the process's peak RSS growth (VmHWM)
while loading it onto the CPU: the loaders never hold the file's whole state, so the growth should stay near
the serving-dtype size (goal: at most 1.3x). The official parts are random, written once under
build/checkpoints/official-parts: the VAE at Wan 2.1's size, the umT5 at a fraction of umT5-XXL's (8 layers
of width 2048; the real one is 11 GB, more than this machine spares).
"""
from __future__ import annotations

import argparse
import resource
import subprocess
import sys
from pathlib import Path

import torch

from backend.launch.procfs import status_kib
from backend.model.checkpoint import load_transformer
from backend.model.config import read_checkpoint_configs
from backend.model.dtypes import DTYPES, torch_dtype
from backend.model.layout_official import load_pth_umt5, load_pth_vae
from backend.model.layouts import resolve_layout
from backend.model.official_names import UMT5_TIED, umt5_names, vae_names
from bench.common import ensure_checkpoint

OFFICIAL_PARTS_DIR = Path("build/checkpoints/official-parts")
UMT5_BENCH = dict(vocab_size=32128, d_model=2048, d_kv=64, d_ff=5120, num_layers=8, num_heads=32)


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss_bytes() -> int:
    return status_kib("self", "VmRSS") * 1024


def official_part_path(part: str) -> Path:
    return OFFICIAL_PARTS_DIR / ("Wan2.1_VAE.pth" if part == "vae" else "models_t5_umt5-enc-bf16.pth")


def write_official_part(part: str) -> None:
    """A random .pth in the official naming: Wan 2.1's VAE (float32) or a smaller umT5 (bfloat16)."""
    path = official_part_path(part)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    if part == "vae":
        from diffusers import AutoencoderKLWan

        model = AutoencoderKLWan()  # Wan 2.1's architecture
        names = {new: old for old, new in vae_names(model).items()}
        torch.save({names[k]: v for k, v in model.state_dict().items()}, path)
    else:
        from transformers import UMT5Config, UMT5EncoderModel

        model = UMT5EncoderModel(UMT5Config(**UMT5_BENCH)).to(torch.bfloat16)
        names = {new: old for old, new in umt5_names(model).items()}
        torch.save({names[k]: v for k, v in model.state_dict().items() if k not in UMT5_TIED}, path)


def load_official_part(part: str, dtype: torch.dtype) -> None:
    path = official_part_path(part)
    if not path.is_file():
        write_official_part(part)  # writing it raised this process's peak (kept across exec): measure in a child
        subprocess.run([sys.executable, "-m", "bench.loading", *sys.argv[1:]], check=True)
        return
    torch.ones(1)
    before = current_rss_bytes()
    model = (load_pth_vae if part == "vae" else load_pth_umt5)(path, dtype, torch.device("cpu"))
    growth = peak_rss_bytes() - before
    unique = {p.data_ptr(): p for p in model.parameters()}.values()  # umT5's tied embedding once
    weights = sum(p.numel() * p.element_size() for p in unique)
    mib = 2**20
    print(f"| {path.name} ({part}, {sum(p.numel() for p in unique) / 1e6:.0f} M parameters) |")
    print(f"| on disk | {path.stat().st_size / mib:.0f} MiB |")
    print(f"| weights in {str(dtype).removeprefix('torch.')} | {weights / mib:.0f} MiB |")
    print(f"| peak RSS growth while loading | {growth / mib:.0f} MiB ({growth / weights:.2f}x the served size) |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("transformer", "vae", "text_encoder"), default="transformer")
    parser.add_argument("--preset", default="mid")
    parser.add_argument("--checkpoint", type=Path)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="serving dtype (default: bfloat16, float32 for the VAE)")
    args = parser.parse_args()
    dtype = torch_dtype(args.dtype or ("float32" if args.part == "vae" else "bfloat16"))
    if args.part != "transformer":
        load_official_part(args.part, dtype)
        return
    args.dtype = str(dtype).removeprefix("torch.")
    root = ensure_checkpoint(args.checkpoint, args.preset)
    configs = read_checkpoint_configs(resolve_layout(str(root)))
    config, directory = configs.transformer, configs.layout.transformer
    on_disk = sum(p.stat().st_size for p in directory.glob("*.safetensors"))
    torch.ones(1)  # torch's own allocations before the baseline
    before = current_rss_bytes()
    model = load_transformer(directory, config, torch_dtype(args.dtype), torch.device("cpu"))
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    growth = peak_rss_bytes() - before
    gib = 2**30
    print(f"| checkpoint | {root} ({config.num_layers} layers, dim {config.dim}) |")
    print(f"| on disk (FP32 shards) | {on_disk / gib:.2f} GiB |")
    print(f"| weights in {args.dtype} | {weights / gib:.2f} GiB |")
    print(f"| peak RSS growth while loading | {growth / gib:.2f} GiB ({growth / weights:.2f}x the {args.dtype} size) |")


if __name__ == "__main__":
    main()
