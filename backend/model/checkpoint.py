"""Loading a diffusers-format model directory: transformer safetensors, Wan VAE, umT5 text encoder."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from .config import TransformerConfig
from ..api.errors import ConfigError
from .transformer import CausalWanTransformer

WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
WEIGHTS_INDEX_NAME = "diffusion_pytorch_model.safetensors.index.json"


def weight_files(directory: Path) -> list[Path]:
    """The safetensors file, or the shards listed by its index, of one component directory."""
    index = directory / WEIGHTS_INDEX_NAME
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [directory / name for name in shards]
    single = directory / WEIGHTS_NAME
    if single.is_file():
        return [single]
    raise ConfigError(f"{directory} holds neither {WEIGHTS_NAME} nor {WEIGHTS_INDEX_NAME}")


def load_state_dict(files: list[Path], device: torch.device) -> dict[str, torch.Tensor]:
    """Tensors straight onto `device` (no host copy of the whole model per rank)."""
    state: dict[str, torch.Tensor] = {}
    for path in files:
        state.update(load_file(str(path), device=str(device)))
    return state


def load_transformer(
    directory: Path, config: TransformerConfig, dtype: torch.dtype, device: torch.device
) -> CausalWanTransformer:
    """Build the DiT from its config and load its weights strictly (missing or extra keys are an error)."""
    with torch.device("meta"):
        model = CausalWanTransformer(config)
    state = load_state_dict(weight_files(directory), device)
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ConfigError(
            f"{directory}: weights do not match the config: missing {missing[:8]}"
            f"{'...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}"
        )
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True, assign=True)
    return model.eval().requires_grad_(False)


def load_vae(directory: Path, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    from diffusers import AutoencoderKLWan

    vae = AutoencoderKLWan.from_pretrained(str(directory), torch_dtype=dtype, low_cpu_mem_usage=False)
    return vae.to(device).eval()


def load_text_encoder(root: Path, dtype: torch.dtype, device: torch.device) -> tuple[torch.nn.Module, object]:
    from transformers import AutoTokenizer, UMT5EncoderModel
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # no progress bars in the server log

    tokenizer = AutoTokenizer.from_pretrained(str(root / "tokenizer"))
    encoder = UMT5EncoderModel.from_pretrained(str(root / "text_encoder"), dtype=dtype)
    return encoder.to(device).eval(), tokenizer
