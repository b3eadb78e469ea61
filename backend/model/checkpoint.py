"""Loading a diffusers-format model directory: transformer shards, Wan VAE, umT5 text encoder.

The transformer is built on the meta device and filled tensor by tensor, shard by shard: each tensor is read
into its own buffer, cast to the serving dtype and placed straight on its device, so the checkpoint's FP32 state
is never held in host memory (at most one source tensor at a time).
"""
from __future__ import annotations

import struct
from pathlib import Path
from typing import BinaryIO

import torch

from ..api.errors import ConfigError
from .config import TransformerConfig
from .tensor_slices import TensorPart
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


def load_into(
    module: torch.nn.Module, directory: Path, dtype: torch.dtype, device: torch.device, part: TensorPart | None = None
) -> None:
    """Fill a (meta) module from a component directory; strict on names and shapes, errors name the file.

    part: a tensor-parallel rank's module, which holds a slice of some tensors; only the slice is read."""
    part = part or TensorPart(0, 1)
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
        split = {}
        for name in names:
            if header.get(name, {}).get("shape") is None:
                raise ConfigError(f"{path}: {name} has no shape, the config expects {expected[name]}")
            split[name] = part.split_dim(f"{path}: {name}", header[name]["shape"], expected[name])
        largest = max(end - begin for begin, end in (header[n]["data_offsets"] for n in names))
        scratch = torch.empty(largest, dtype=torch.uint8)  # one read buffer per shard, reused by every tensor
        with path.open("rb") as shard:
            data_start = 8 + struct.unpack("<Q", shard.read(8))[0]
            for name in names:
                if split[name] is None:
                    tensor = read_tensor(shard, data_start, header[name], path, name, scratch)
                else:
                    tensor = part.read(shard, data_start, header[name], split[name], path, name,
                                       SAFETENSORS_DTYPES.get(header[name]["dtype"]), scratch)
                target = dtype if tensor.is_floating_point() else tensor.dtype
                assign(module, name, tensor.to(device=device, dtype=target, copy=True))
                del tensor


SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}


def read_tensor(
    shard: BinaryIO, data_start: int, entry: dict, path: Path, name: str, scratch: torch.Tensor
) -> torch.Tensor:
    """One tensor, read into the front of `scratch` and viewed there (a plain read, not a memory map: a mapped
    shard would count its whole FP32 data in the process's memory while it is open)."""
    begin, end = entry["data_offsets"]
    buffer = scratch[: end - begin]
    shard.seek(data_start + begin)
    if shard.readinto(buffer.numpy()) != end - begin:
        raise ConfigError(f"cannot read {path}: {name} is cut short (the file is truncated)")
    if entry["dtype"] not in SAFETENSORS_DTYPES:
        raise ConfigError(f"{path}: {name} has dtype {entry['dtype']}, which this loader does not read")
    return buffer.view(SAFETENSORS_DTYPES[entry["dtype"]]).reshape(entry["shape"])


def load_transformer(
    directory: Path, config: TransformerConfig, dtype: torch.dtype, device: torch.device,
    part: TensorPart | None = None,
) -> LingBotTransformer:
    """Build the DiT from its config on the meta device (a tensor-parallel rank's slices with `part`) and load
    its weights strictly."""
    part = part or TensorPart(0, 1)
    with torch.device("meta"):
        model = LingBotTransformer(config, part.degree)
    load_into(model, directory, dtype, device, part)
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
    # Eager attention is the reference T5Encoder's math bit for bit (float32 and bfloat16); SDPA, the default, is not.
    encoder = UMT5EncoderModel.from_pretrained(str(root / "text_encoder"), dtype=dtype, attn_implementation="eager")
    return encoder.to(device).eval(), tokenizer
