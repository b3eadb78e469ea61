"""Loading a checkpoint's models, whichever its layout: transformer shards, .pth state dicts, the tokenizer.

The transformer, and the official download's VAE and umT5 (.pth state dicts under Wan's own names), are built
on the meta device and filled tensor by tensor: each tensor is read into a reused buffer, cast to its serving
dtype and placed straight on its device (`place_tensor`), so a checkpoint's full-precision state is never held
in host memory (at most one source tensor at a time).
"""
from __future__ import annotations

import struct
from pathlib import Path
from typing import BinaryIO

import torch

from ..api.errors import ConfigError
from .config import TransformerConfig
from .pth_files import read_pth_tensors
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


def place_tensor(module: torch.nn.Module, name: str, source: torch.Tensor, dtype: torch.dtype,
                 device: torch.device) -> None:
    """The one read/cast/place point: a source tensor (valid until the next read) becomes the module's tensor
    `name`, floating point in `dtype`, on `device`."""
    target = dtype if source.is_floating_point() else source.dtype
    assign(module, name, source.to(device=device, dtype=target, copy=True))


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
                place_tensor(module, name, tensor, dtype, device)
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


def load_tokenizer(path: Path) -> object:
    """The umT5 tokenizer directory (and, from here on, no progress bars of transformers in the server log)."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    return AutoTokenizer.from_pretrained(str(path))


def fill_from_pth(module: torch.nn.Module, path: Path, index: dict, names: dict[str, str], dtype: torch.dtype,
                  device: torch.device) -> None:
    """Fill a meta module from a .pth state dict under other names ({file name: module name}); strict: every
    tensor of the file is used, every tensor of the module filled, every shape equal."""
    unknown, missing = sorted(set(index) - set(names)), sorted(set(names) - set(index))
    if unknown or missing:
        raise ConfigError(
            f"{path}: tensors do not match {type(module).__name__}: unknown {len(unknown)} [{few_names(unknown)}], "
            f"missing {len(missing)} [{few_names(missing)}]"
        )
    expected = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    for name, target in names.items():
        if index[name].shape != expected[target]:
            raise ConfigError(f"{path}: {name} has shape {list(index[name].shape)}, {target} needs {list(expected[target])}")
    for name, tensor in read_pth_tensors(path, index, list(index)):
        place_tensor(module, names[name], tensor, dtype, device)
