"""The official download's VAE and umT5 state dicts, named for the classes this server runs.

`Wan2.1_VAE.pth` holds Wan's own VAE (`WanVAE_`: encoder.downsamples / decoder.upsamples as flat lists,
residual blocks as `residual.{0,2,3,6}` sequences, `head.{0,2}`, top-level conv1/conv2) and
`models_t5_umt5-xxl-enc-bf16.pth` Wan's own umT5 encoder (`T5Encoder`: token_embedding, blocks.{i}.attn /
ffn.gate.0, fc1, fc2 / pos_embedding / norm1, norm2, norm). Here both are renamed for diffusers'
`AutoencoderKLWan` and transformers' `UMT5EncoderModel`, and their architectures are read from the names and
shapes alone (no tensor data). The maps are built from the target module, one official name per target
tensor, so a tensor the target lacks or the file lacks is found by comparing the two name sets.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

from ..api.errors import ConfigError
from .pth_files import PthTensor

if TYPE_CHECKING:  # hints only: the architectures are read without torch (the launcher's start-up check)
    import torch

# Wan VAE residual block: Sequential(RMS_norm, SiLU, conv, RMS_norm, SiLU, Dropout, conv) and its shortcut.
_RESIDUAL = {"norm1.": "residual.0.", "conv1.": "residual.2.", "norm2.": "residual.3.", "conv2.": "residual.6.",
             "conv_shortcut.": "shortcut."}
_ENDS = {"conv_in.": "conv1.", "norm_out.": "head.0.", "conv_out.": "head.2."}
_MIDDLE = {"resnets.0.": "0.", "attentions.0.": "1.", "resnets.1.": "2."}


def vae_arguments(index: Mapping[str, PthTensor], path: object) -> dict:
    """AutoencoderKLWan's architecture from the official state dict's names and shapes."""
    try:
        base_dim = index["encoder.conv1.weight"].shape[0]
        z_dim = index["conv2.weight"].shape[0]
    except KeyError as exc:
        raise ConfigError(f"{path}: no tensor {exc.args[0]!r}; is this Wan's VAE (Wan2.1_VAE.pth)?") from exc
    levels: list[list[int]] = [[]]  # residual blocks' output widths per resolution level
    temporal: list[bool] = []
    i = 0
    while f"encoder.downsamples.{i}.residual.6.weight" in index or f"encoder.downsamples.{i}.resample.1.weight" in index:
        if f"encoder.downsamples.{i}.resample.1.weight" in index:
            temporal.append(f"encoder.downsamples.{i}.time_conv.weight" in index)
            levels.append([])
        else:
            levels[-1].append(index[f"encoder.downsamples.{i}.residual.6.weight"].shape[0])
        i += 1
    if any(name.startswith("encoder.downsamples.") and ".norm.gamma" in name for name in index):
        raise ConfigError(f"{path}: attention in the encoder's down blocks (attn_scales) is not supported")
    if not all(levels) or len({len(level) for level in levels}) != 1:
        raise ConfigError(f"{path}: the encoder's down blocks do not form levels of equal depth")
    return {
        "base_dim": base_dim,
        "z_dim": z_dim,
        "dim_mult": [level[-1] // base_dim for level in levels],
        "num_res_blocks": len(levels[0]),
        "temperal_downsample": temporal,
    }


def vae_names(vae: torch.nn.Module) -> dict[str, str]:
    """{official name: AutoencoderKLWan name} for every tensor of `vae` (built with vae_arguments)."""
    flat_up: dict[str, str] = {}  # "up_blocks.{i}.resnets.{j}." -> "upsamples.{k}."
    k = 0
    for i, block in enumerate(vae.decoder.up_blocks):
        for j in range(len(block.resnets)):
            flat_up[f"up_blocks.{i}.resnets.{j}."] = f"upsamples.{k}."
            k += 1
        if block.upsamplers is not None:
            flat_up[f"up_blocks.{i}.upsamplers.0."] = f"upsamples.{k}."
            k += 1
    return {_official_vae_name(name, flat_up): name for name in vae.state_dict()}


def _official_vae_name(name: str, flat_up: Mapping[str, str]) -> str:
    if name.startswith("quant_conv."):
        return "conv1." + name.removeprefix("quant_conv.")
    if name.startswith("post_quant_conv."):
        return "conv2." + name.removeprefix("post_quant_conv.")
    part, rest = name.split(".", 1)  # encoder / decoder
    for new, old in _ENDS.items():
        if rest.startswith(new):
            return f"{part}.{old}{rest.removeprefix(new)}"
    if rest.startswith("mid_block."):
        rest = rest.removeprefix("mid_block.")
        block = next(new for new in _MIDDLE if rest.startswith(new))
        return f"{part}.middle.{_MIDDLE[block]}{_residual(rest.removeprefix(block))}"
    match = re.match(r"down_blocks\.(\d+)\.", rest)
    if match:
        return f"{part}.downsamples.{match.group(1)}.{_residual(rest[match.end():])}"
    match = re.match(r"up_blocks\.\d+\.(resnets\.\d+|upsamplers\.0)\.", rest)
    if match:
        return f"{part}.{flat_up[match.group(0)]}{_residual(rest[match.end():])}"
    raise ConfigError(f"AutoencoderKLWan tensor {name!r} has no counterpart in Wan's VAE")


def _residual(leaf: str) -> str:
    """A residual block's tensor in Wan's sequence naming (resample and attention names are the same)."""
    for new, old in _RESIDUAL.items():
        if leaf.startswith(new):
            return old + leaf.removeprefix(new)
    return leaf


def umt5_arguments(index: Mapping[str, PthTensor], path: object) -> dict:
    """UMT5Config arguments from the official encoder's names and shapes (umT5: a relative bias per layer)."""
    try:
        vocab, d_model = index["token_embedding.weight"].shape
        buckets, heads = index["blocks.0.pos_embedding.embedding.weight"].shape
        d_ff = index["blocks.0.ffn.fc1.weight"].shape[0]
        inner = index["blocks.0.attn.q.weight"].shape[0]
    except KeyError as exc:
        raise ConfigError(f"{path}: no tensor {exc.args[0]!r}; is this Wan's umT5 encoder?") from exc
    layers = 0
    while f"blocks.{layers}.attn.q.weight" in index:
        layers += 1
    return {
        "vocab_size": vocab, "d_model": d_model, "d_kv": inner // heads, "d_ff": d_ff, "num_layers": layers,
        "num_heads": heads, "relative_attention_num_buckets": buckets, "relative_attention_max_distance": 128,
        "feed_forward_proj": "gated-gelu", "layer_norm_epsilon": 1e-6,
    }


# UMT5EncoderModel's input embedding is `shared`, tied to encoder.embed_tokens.
UMT5_TIED = {"encoder.embed_tokens.weight": "shared.weight"}
_UMT5_LAYER = {
    "layer.0.SelfAttention.q.": "attn.q.", "layer.0.SelfAttention.k.": "attn.k.", "layer.0.SelfAttention.v.": "attn.v.",
    "layer.0.SelfAttention.o.": "attn.o.", "layer.0.SelfAttention.relative_attention_bias.": "pos_embedding.embedding.",
    "layer.0.layer_norm.": "norm1.", "layer.1.DenseReluDense.wi_0.": "ffn.gate.0.",
    "layer.1.DenseReluDense.wi_1.": "ffn.fc1.", "layer.1.DenseReluDense.wo.": "ffn.fc2.", "layer.1.layer_norm.": "norm2.",
}


def umt5_names(encoder: torch.nn.Module) -> dict[str, str]:
    """{official name: UMT5EncoderModel name} for every tensor of `encoder` but the tied embed_tokens."""
    return {_official_umt5_name(name): name for name in encoder.state_dict() if name not in UMT5_TIED}


def _official_umt5_name(name: str) -> str:
    if name == "shared.weight":
        return "token_embedding.weight"
    if name.startswith("encoder.final_layer_norm."):
        return "norm." + name.removeprefix("encoder.final_layer_norm.")
    match = re.match(r"encoder\.block\.(\d+)\.", name)
    if match:
        leaf = name[match.end():]
        for new, old in _UMT5_LAYER.items():
            if leaf.startswith(new):
                return f"blocks.{match.group(1)}.{old}{leaf.removeprefix(new)}"
    raise ConfigError(f"UMT5EncoderModel tensor {name!r} has no counterpart in Wan's umT5 encoder")
