"""Tensor parallelism: one rank's view of its TP group (all-reduce of row-parallel partial sums, all-gather of
channel slices); degree 1 makes every operation the identity."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class TensorCommStats:
    """Payload bytes this rank handed to TP collectives since the last reset (the engine resets it per block):
    the size of each all-reduced tensor (a ring all-reduce sends 2 (tp - 1) / tp of it) and of each slice
    this rank contributes to an all-gather (it sends it to the tp - 1 others, a ring forwards (tp - 1) slices)."""

    all_reduce_bytes: int = 0
    all_gather_bytes: int = 0

    def reset(self) -> None:
        self.all_reduce_bytes = self.all_gather_bytes = 0


class TensorParallel:
    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.degree = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        self.stats = TensorCommStats()

    def part(self, n: int) -> slice:
        """This rank's contiguous share of n (heads, channels, features)."""
        local = n // self.degree
        return slice(self.rank * local, (self.rank + 1) * local)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's x (in place)."""
        if self.degree > 1:
            dist.all_reduce(x, group=self.group)
            self.stats.all_reduce_bytes += x.numel() * x.element_size()
        return x

    def gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's slice of the last dim, concatenated in rank order."""
        if self.degree == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.degree)]
        dist.all_gather(parts, x, group=self.group)
        self.stats.all_gather_bytes += x.numel() * x.element_size()
        return torch.cat(parts, dim=-1)
