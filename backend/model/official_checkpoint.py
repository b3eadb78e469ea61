"""Write a random checkpoint in the official download's layout (robbyant/lingbot-world-v2-14b-causal-fast).

    python -m backend.model.official_checkpoint OUT_DIR [--preset tiny16|mid] [--seed 0]

`transformers/` (the DiT's config.json and safetensors shards), `Wan2.1_VAE.pth` and
`models_t5_umt5-xxl-enc-bf16.pth` (state dicts under Wan's own names, written with torch.save; the umT5 in
bfloat16 as published), `google/umt5-xxl/` (the tokenizer). `official_copy` writes the same weights as a
diffusers-layout checkpoint holds, so the two layouts can be compared tensor for tensor.
"""
from __future__ import annotations

import argparse
import inspect
import shutil
import tempfile
from pathlib import Path

import torch

from ..api.errors import ConfigError
from .layout_official import OFFICIAL
from .layouts import resolve_layout
from .official_names import UMT5_TIED, umt5_names, vae_names
from .tiny_checkpoint import PRESETS, write_checkpoint

OFFICIAL_TEXT_DTYPE = torch.bfloat16  # models_t5_umt5-xxl-enc-bf16.pth


def official_copy(source: Path, out: Path) -> Path:
    """The weights of a checkpoint, in whichever layout (as that layout loads them), written in the official layout."""
    from diffusers import AutoencoderKLWan

    layout, cpu = resolve_layout(str(source)), torch.device("cpu")
    out.mkdir(parents=True, exist_ok=True)
    shutil.copytree(layout.transformer, out / OFFICIAL.parts["transformer"])
    shutil.copytree(layout.tokenizer, out / OFFICIAL.parts["tokenizer"])

    vae = layout.load_vae(torch.float32, cpu)
    wan21 = {k: inspect.signature(AutoencoderKLWan.__init__).parameters[k].default
             for k in ("latents_mean", "latents_std")}
    if any(list(vae.config[k]) != v for k, v in wan21.items()):
        raise ConfigError(f"{layout.vae}: latent statistics other than Wan 2.1's; the official layout cannot carry them")
    official = {diffusers: name for name, diffusers in vae_names(vae).items()}
    torch.save({official[k]: v for k, v in vae.state_dict().items()}, out / OFFICIAL.parts["vae"])

    encoder, _ = layout.load_text_encoder(torch.float32, cpu)
    official = {hf: name for name, hf in umt5_names(encoder).items()}
    state = {official[k]: v.to(OFFICIAL_TEXT_DTYPE) for k, v in encoder.state_dict().items() if k not in UMT5_TIED}
    torch.save(state, out / OFFICIAL.parts["text_encoder"])
    return out


def write_official_checkpoint(root: Path, preset_name: str = "tiny16", seed: int = 0) -> Path:
    """A random checkpoint in the official layout (written in the diffusers layout first, then converted)."""
    with tempfile.TemporaryDirectory() as tmp:
        return official_copy(write_checkpoint(Path(tmp) / "diffusers", preset_name, seed), root)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--preset", choices=[p for p in sorted(PRESETS) if PRESETS[p].get("wan21_latents")],
                        default="tiny16")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(write_official_checkpoint(args.out, args.preset, args.seed))


if __name__ == "__main__":
    main()
