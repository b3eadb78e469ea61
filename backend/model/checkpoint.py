"""Loading a diffusers-format model directory: transformer shards, Wan VAE, umT5 text encoder.

The transformer is built on the meta device and filled tensor by tensor, shard by shard: each tensor is cast
to the serving dtype as it is read and placed straight on its device, so the checkpoint's FP32 state is
never held in host memory (at most one source tensor at a time).
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from ..api.errors import ConfigError
from .config import TransformerConfig
from .transformer import LingBotTransformer
from .weight_files import few_names, read_header, shard_plan


def assign(module: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    """Put `value` in place of the parameter or buffer `name` (frozen), whatever device the old one was on."""
    owner_name, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_name)
    if leaf in owner._parameters:
        owner._parameters[leaf] = torch.nn.Parameter(value, requires_grad=False)
    else:
        owner._buffers[leaf] = value


def load_into(module: torch.nn.Module, directory: Path, dtype: torch.dtype, device: torch.device) -> None:
    """Fill a (meta) module from a component directory; strict on names and shapes, errors name the file."""
    plan = shard_plan(directory)
    expected = {k: list(v.shape) for k, v in module.state_dict().items()}
    found = {name for names in plan.values() for name in names}
    missing, unexpected = sorted(set(expected) - found), sorted(found - set(expected))
    if missing or unexpected:
        raise ConfigError(
            f"{directory}: weights do not match the config: missing {len(missing)} [{few_names(missing)}], "
            f"unexpected {len(unexpected)} [{few_names(unexpected)}]"
        )
    for path, names in plan.items():
        header = read_header(path)
        for name in names:
            if header.get(name, {}).get("shape") != expected[name]:
                raise ConfigError(
                    f"{path}: {name} has shape {header.get(name, {}).get('shape')}, the config expects {expected[name]}"
                )
        try:
            with safe_open(str(path), framework="pt", device="cpu") as shard:
                for name in names:
                    tensor = shard.get_tensor(name)
                    target = dtype if tensor.is_floating_point() else tensor.dtype
                    assign(module, name, tensor.to(device=device, dtype=target))
                    del tensor
        except (OSError, RuntimeError, ValueError) as exc:  # safetensors raises its own errors on bad data
            raise ConfigError(f"cannot read {path}: {exc}") from exc


def load_transformer(
    directory: Path, config: TransformerConfig, dtype: torch.dtype, device: torch.device
) -> LingBotTransformer:
    """Build the DiT from its config on the meta device and load its weights strictly."""
    with torch.device("meta"):
        model = LingBotTransformer(config)
    load_into(model, directory, dtype, device)
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
