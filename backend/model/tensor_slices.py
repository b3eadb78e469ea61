"""A tensor-parallel rank's slice of a checkpoint tensor, read from its shard without the rest of it.

Which dim a tensor is split along is derived from the shapes alone: the module built for tp ranks holds
1/tp of exactly one dim of a split tensor (transformer.py decides which), all of a replicated one.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from ..api.errors import ConfigError


@dataclass(frozen=True)
class TensorPart:
    """Rank `rank` of `degree` tensor-parallel ranks."""

    rank: int
    degree: int

    def split_dim(self, name: str, full: list[int], local: list[int]) -> int | None:
        """The dim this rank holds 1/degree of (None: it holds the whole tensor); an error names any other
        mismatch of the checkpoint's shape `full` and the module's `local`."""
        if full == local:
            return None
        differ = [d for d, (f, m) in enumerate(zip(full, local)) if f != m]
        if len(full) != len(local) or len(differ) != 1 or full[differ[0]] != local[differ[0]] * self.degree:
            tp = f" (tp_degree={self.degree})" if self.degree > 1 else ""
            raise ConfigError(f"{name} has shape {full}, the config expects {local}{tp}")
        return differ[0]

    def read(
        self, shard: BinaryIO, data_start: int, entry: dict, dim: int, path: Path, name: str,
        dtype: torch.dtype | None, scratch: torch.Tensor,
    ) -> torch.Tensor:
        """This rank's slice along `dim` of one tensor, read run by run into the front of `scratch`: a C-order
        slice along dim d is prod(shape[:d]) contiguous runs of shape[d]/degree x prod(shape[d+1:]) elements.
        Positional reads on the descriptor, past the file object's buffer: only the slice's bytes are read."""
        if dtype is None:
            raise ConfigError(f"{path}: {name} has dtype {entry['dtype']}, which this loader does not read")
        shape = entry["shape"]
        item = torch.empty((), dtype=dtype).element_size()
        inner = math.prod(shape[dim + 1:]) * item
        run, stride = shape[dim] // self.degree * inner, shape[dim] * inner
        begin = data_start + entry["data_offsets"][0] + self.rank * run
        runs = math.prod(shape[:dim])
        buffer = memoryview(scratch[: runs * run].numpy())
        fd = shard.fileno()
        for i in range(runs):
            if os.preadv(fd, [buffer[i * run : (i + 1) * run]], begin + i * stride) != run:
                raise ConfigError(f"cannot read {path}: {name} is cut short (the file is truncated)")
        local = list(shape)
        local[dim] //= self.degree
        return scratch[: runs * run].view(dtype).reshape(local)
