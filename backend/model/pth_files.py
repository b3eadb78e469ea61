"""Tensors of a `torch.save` archive (.pth), listed from its pickle and read one at a time.

The pickle is read with an allow-list (tensors, parameters, ordered dicts: no code runs), and each tensor's
storage is read straight from its place in the zip into a reused buffer: the file is neither unpickled whole
nor memory-mapped (a mapped file counts in the process's memory as it is read), so at most one source tensor
is held at a time, as with the safetensors shards (see checkpoint.load_into).
"""
from __future__ import annotations

import collections
import pickle
import struct
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..api.errors import ConfigError

if TYPE_CHECKING:  # the index is read without torch (the launcher's start-up check); only the tensors need it
    import torch

# A storage class's name -> its elements' torch dtype, by name, and their bytes
STORAGE_DTYPES = {
    "FloatStorage": "float32", "DoubleStorage": "float64", "HalfStorage": "float16", "BFloat16Storage": "bfloat16",
    "LongStorage": "int64", "IntStorage": "int32", "ShortStorage": "int16", "CharStorage": "int8",
    "ByteStorage": "uint8", "BoolStorage": "bool",
}
ITEM_BYTES = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2, "int8": 1,
              "uint8": 1, "bool": 1}
LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")  # a zip member's local file header (30 bytes)


@dataclass(frozen=True)
class _StorageType:
    dtype: str  # a torch dtype's name


@dataclass(frozen=True)
class PthTensor:
    """Where one tensor of the archive lies: its storage record and its view of it."""

    storage: str  # record name in the zip, e.g. "archive/data/0"
    dtype: str  # a torch dtype's name, e.g. "bfloat16"
    storage_numel: int
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def storage_bytes(self) -> int:
        return self.storage_numel * ITEM_BYTES[self.dtype]


@dataclass(frozen=True)
class _Storage:
    record: str
    dtype: str
    numel: int


def _rebuild_tensor(storage: _Storage, offset: int, shape: tuple, stride: tuple, *_: object) -> PthTensor:
    return PthTensor(storage.record, storage.dtype, storage.numel, offset, tuple(shape), tuple(stride))


def _rebuild_parameter(data: PthTensor, *_: object) -> PthTensor:
    return data


class _IndexUnpickler(pickle.Unpickler):
    """Reads the archive's data.pkl into {name: PthTensor}; any other global is refused by name."""

    def __init__(self, file: object, prefix: str, path: Path) -> None:
        super().__init__(file)
        self.prefix, self.path = prefix, path

    def find_class(self, module: str, name: str) -> object:
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_tensor
        if module == "torch._utils" and name == "_rebuild_parameter":
            return _rebuild_parameter
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        if module == "torch" and name in STORAGE_DTYPES:
            return _StorageType(STORAGE_DTYPES[name])
        raise ConfigError(f"{self.path}: holds {module}.{name}, not a plain state dict of tensors")

    def persistent_load(self, pid: tuple) -> _Storage:
        kind, dtype, key, _location, numel = pid
        if kind != "storage" or not isinstance(dtype, _StorageType):
            raise ConfigError(f"{self.path}: unexpected storage record {pid!r}")
        return _Storage(f"{self.prefix}/data/{key}", dtype.dtype, int(numel))


def read_pth_index(path: Path) -> dict[str, PthTensor]:
    """{tensor name: where it lies} of a zip-format torch.save file holding a flat state dict."""
    try:
        with zipfile.ZipFile(path) as archive:
            pickles = [n for n in archive.namelist() if n.endswith("/data.pkl")]
            if len(pickles) != 1:
                raise ConfigError(f"{path} is not a torch.save archive (no single data.pkl)")
            prefix = pickles[0].rsplit("/", 1)[0]
            byteorder = f"{prefix}/byteorder"
            if byteorder in archive.namelist() and archive.read(byteorder).decode() != "little":
                raise ConfigError(f"{path} is saved big-endian; this loader reads little-endian archives")
            with archive.open(pickles[0]) as pkl:
                state = _IndexUnpickler(pkl, prefix, path).load()
    except (OSError, zipfile.BadZipFile, pickle.UnpicklingError, EOFError) as exc:
        raise ConfigError(f"{path} is not a readable torch.save zip archive: {exc}") from exc
    if not isinstance(state, dict) or not all(isinstance(v, PthTensor) for v in state.values()):
        raise ConfigError(f"{path} does not hold a flat state dict of tensors")
    return dict(state)


def read_pth_tensors(path: Path, index: dict[str, PthTensor], names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Each named tensor in turn, a view into one read buffer reused by the next: use it before the next."""
    import torch

    scratch = torch.empty(max(index[n].storage_bytes for n in names), dtype=torch.uint8)
    with zipfile.ZipFile(path) as archive, path.open("rb") as raw:
        for name in names:
            entry = index[name]
            info = archive.getinfo(entry.storage)
            if info.compress_type != zipfile.ZIP_STORED or info.file_size != entry.storage_bytes:
                raise ConfigError(f"{path}: {name}'s storage {entry.storage} is compressed or of the wrong size")
            raw.seek(info.header_offset)
            fields = LOCAL_HEADER.unpack(raw.read(LOCAL_HEADER.size))
            raw.seek(info.header_offset + LOCAL_HEADER.size + fields[9] + fields[10])
            buffer = scratch[: entry.storage_bytes]
            if raw.readinto(buffer.numpy()) != entry.storage_bytes:
                raise ConfigError(f"cannot read {path}: {name} is cut short (the file is truncated)")
            flat = buffer.view(getattr(torch, entry.dtype))
            yield name, torch.as_strided(flat, entry.shape, entry.stride, entry.offset)
