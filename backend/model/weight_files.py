"""Where a component's tensors are: its safetensors file, or the shards its index lists (torch-free)."""
from __future__ import annotations

import json
import struct
from pathlib import Path

from ..api.errors import ConfigError

WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
WEIGHTS_INDEX_NAME = WEIGHTS_NAME + ".index.json"


def few_names(names: list[str], n: int = 6) -> str:
    names = sorted(names)
    return ", ".join(names[:n]) + (f" ... (+{len(names) - n} more)" if len(names) > n else "")


def shard_plan(directory: Path) -> dict[Path, list[str]]:
    """{shard file: tensor names} from the index, or {the single file: its tensor names}."""
    index = directory / WEIGHTS_INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as exc:
            raise ConfigError(f"{index} is not a safetensors index (no weight_map): {exc}") from exc
        plan: dict[Path, list[str]] = {}
        for name, file in weight_map.items():
            plan.setdefault(directory / file, []).append(name)
        missing = [str(p) for p in plan if not p.is_file()]
        if missing:
            raise ConfigError(f"shard file(s) listed in {index} not found: {few_names(missing)}")
        return plan
    single = directory / WEIGHTS_NAME
    if single.is_file():
        return {single: list(read_header(single))}
    raise ConfigError(f"{directory} holds neither {WEIGHTS_NAME} nor {WEIGHTS_INDEX_NAME}")


def read_header(path: Path) -> dict[str, dict]:
    """The tensors' dtypes and shapes of one safetensors file, from its JSON header (no tensor data)."""
    try:
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
    except (OSError, struct.error, ValueError) as exc:
        raise ConfigError(f"{path} is not a readable safetensors file: {exc}") from exc
    header.pop("__metadata__", None)
    return header


def tensor_shape(directory: Path, name: str) -> list[int]:
    """One tensor's shape, read from a header."""
    for path, names in shard_plan(directory).items():
        if name in names:
            return list(read_header(path)[name]["shape"])
    raise ConfigError(f"{directory} has no tensor {name!r}")
