"""Loading a checkpoint in either layout (see layout): transformer shards, Wan VAE, umT5 text encoder.

The transformer, and the official download's VAE and umT5 (.pth state dicts under Wan's own names), are built
on the meta device and filled tensor by tensor: each tensor is read into a reused buffer, cast to its serving
dtype and placed straight on its device (`place_tensor`), so a checkpoint's full-precision state is never held
in host memory (at most one source tensor at a time).
"""
from __future__ import annotations

import inspect
import struct
from pathlib import Path
from typing import BinaryIO

import torch

from ..api.errors import ConfigError
from .config import TransformerConfig
from .layout import CheckpointLayout
from .official_names import UMT5_TIED, umt5_arguments, umt5_names, vae_arguments, vae_names
from .pth_files import read_pth_index, read_pth_tensors
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


def load_vae(layout: CheckpointLayout, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    from diffusers import AutoencoderKLWan

    if not layout.official:
        vae = AutoencoderKLWan.from_pretrained(str(layout.vae), torch_dtype=dtype, low_cpu_mem_usage=False)
        return vae.to(device).eval()
    return load_pth_vae(layout.vae, dtype, device)


def load_text_encoder(layout: CheckpointLayout, dtype: torch.dtype, device: torch.device) -> tuple[torch.nn.Module, object]:
    from transformers import AutoTokenizer, UMT5EncoderModel
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # no progress bars in the server log

    tokenizer = AutoTokenizer.from_pretrained(str(layout.tokenizer))
    if not layout.official:
        # Eager attention is the reference T5Encoder's math bit for bit (float32 and bfloat16); SDPA, the default,
        # is not.
        encoder = UMT5EncoderModel.from_pretrained(str(layout.text_encoder), dtype=dtype, attn_implementation="eager")
        return encoder.to(device).eval(), tokenizer
    return load_pth_umt5(layout.text_encoder, dtype, device), tokenizer


def load_pth_vae(path: Path, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """AutoencoderKLWan from Wan's own VAE state dict (Wan2.1_VAE.pth), its architecture read from the names."""
    from diffusers import AutoencoderKLWan

    index = read_pth_index(path)
    arguments = vae_arguments(index, path)
    wan21_mean = inspect.signature(AutoencoderKLWan.__init__).parameters["latents_mean"].default
    if arguments["z_dim"] != len(wan21_mean):
        raise ConfigError(
            f"{path}: z_dim {arguments['z_dim']}; the official layout carries no latent statistics, and "
            f"Wan 2.1's (AutoencoderKLWan's defaults) are for z_dim {len(wan21_mean)}"
        )
    with torch.device("meta"):
        vae = AutoencoderKLWan(**arguments)  # latents_mean / latents_std: Wan 2.1's, as Wan2_1_VAE hard-codes
    fill_from_pth(vae, path, index, vae_names(vae), dtype, device)
    return vae.eval().requires_grad_(False)


def load_pth_umt5(path: Path, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """UMT5EncoderModel from Wan's own umT5 encoder state dict, its architecture read from the names."""
    from transformers import UMT5Config, UMT5EncoderModel

    index = read_pth_index(path)
    with torch.device("meta"):
        encoder = UMT5EncoderModel(UMT5Config(**umt5_arguments(index, path), attn_implementation="eager"))
    fill_from_pth(encoder, path, index, umt5_names(encoder), dtype, device)
    for tied, source in UMT5_TIED.items():
        assign(encoder, tied, encoder.get_parameter(source))
    return encoder.eval().requires_grad_(False)


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
