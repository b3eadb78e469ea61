"""One part of a snapshot as one safetensors file: written under a temporary name, fsynced, hashed, renamed; read
back only after its size and SHA-256 match its manifest entry.

A tensor is stored dense in its logical shape (a reader slices its heads or rows); where its memory order was
another (the VAE's channels-last feature caches), the entry's meta keeps the order so that the restored tensor has
the same strides, and every kernel after it takes the same path.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import shutil
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .manifest import FileEntry, file_name, invalid

DIM_ORDERS = "dim_orders"  # meta key: {tensor name: its dims from the largest stride to the smallest}


@dataclass
class Part:
    """What one rank writes into one file: tensors (copies, or tensors nothing writes into again) and metadata."""

    role: str
    rank: int
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any] = field(default_factory=dict)
    heads: tuple[int, int] | None = None  # kv: global heads [first, end)
    rows: tuple[int, int] | None = None  # decode: latent rows [first, end)

    @property
    def name(self) -> str:
        return file_name(self.role, self.rank)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def write_part(folder: Path, part: Part) -> FileEntry:
    """Write `part` into `folder` (which must exist): a temporary name, fsync, SHA-256, then the rename to its
    name and an fsync of the folder, so the file is either whole under its name or absent. Any error removes the
    temporary file and propagates."""
    orders = {key: dim_order(t) for key, t in part.tensors.items()}
    dense = {key: t.detach().to("cpu").contiguous() for key, t in part.tensors.items()}
    final = folder / part.name
    temporary = folder / f".{part.name}.{secrets.token_hex(8)}.tmp"
    try:
        save_file(dense, str(temporary))
        with open(temporary, "rb") as f:
            os.fsync(f.fileno())
            digest = hashlib.file_digest(f, "sha256").hexdigest()
        size = temporary.stat().st_size
        os.replace(temporary, final)
        fsync_folder(folder)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    meta = part.meta | {DIM_ORDERS: {k: o for k, o in orders.items() if o != list(range(len(o)))}}
    return FileEntry(part.name, part.role, part.rank, size, digest, part.heads, part.rows, meta)


def copy_file(source: Path, folder: Path, entry: FileEntry) -> FileEntry:
    """`entry`'s file from folder `source` into `folder` the way `write_part` writes one (a temporary name, fsync,
    rename, fsync of the folder): the same bytes, so the same entry (its SHA-256 is checked where it is read)."""
    final = folder / entry.name
    temporary = folder / f".{entry.name}.{secrets.token_hex(8)}.tmp"
    try:
        shutil.copyfile(source / entry.name, temporary, follow_symlinks=False)
        with open(temporary, "rb") as f:
            os.fsync(f.fileno())
        if temporary.stat().st_size != entry.bytes:
            raise invalid(f"{entry.name} is not {entry.bytes} bytes where it is copied from")
        os.replace(temporary, final)
        fsync_folder(folder)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return entry


def fsync_folder(folder: Path) -> None:
    descriptor = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def verify(folder: Path, entry: FileEntry, check_hash: bool = True) -> Path:
    """The path of `entry`'s file once it is a plain file (not a link) of its size and SHA-256 (its size alone
    without `check_hash`); SnapshotError (SNAPSHOT_INVALID) otherwise."""
    path = folder / entry.name
    try:
        info = os.lstat(path)
        if not stat.S_ISREG(info.st_mode) or info.st_size != entry.bytes:
            raise invalid(f"{entry.name} is not a file of {entry.bytes} bytes (truncated or replaced)")
        if not check_hash:
            return path
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(descriptor, "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
    except OSError as exc:
        raise invalid(f"{entry.name} cannot be read ({exc.strerror or exc.__class__.__name__})") from None
    if digest != entry.sha256:
        raise invalid(f"{entry.name}: its SHA-256 differs from its manifest's (corrupted or altered)")
    return path


@contextlib.contextmanager
def reading(folder: Path, entry: FileEntry, check_hash: bool = True) -> Iterator[Any]:
    """The verified file's tensors (safetensors `safe_open`: `get_slice(name)[...]` reads only that part)."""
    with safe_open(str(verify(folder, entry, check_hash)), framework="pt", device="cpu") as f:
        yield f


def dim_order(t: torch.Tensor) -> list[int]:
    """Its dims from the largest stride to the smallest (ties in dim order): a dense tensor's memory order."""
    return sorted(range(t.dim()), key=lambda d: -t.stride(d))


def laid_out(t: torch.Tensor, entry: FileEntry, key: str) -> torch.Tensor:
    """A tensor read back, in the memory order its writer's had (dense in its logical shape if none is kept)."""
    order = entry.meta.get(DIM_ORDERS, {}).get(key)
    if order is None:
        return t
    if sorted(order) != list(range(t.dim())):
        raise invalid(f"{entry.name}: the memory order of {key!r} is not a permutation of its dims")
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return t.permute(order).contiguous().permute(inverse)
