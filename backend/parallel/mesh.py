"""The TP x SP split of a group (its grid in parallel/grid): each rank's TP group and its TP slice's SP group.

The whole group (a SequenceParallel over every rank) keeps the group-wide work: broadcasts from the encoder
rank, the split decode, the control plane. The model's exchanges use the mesh's two subgroups.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch.distributed as dist

from .grid import RankGrid
from .sequence import SequenceParallel
from .tensor import TensorParallel


@dataclass
class Mesh:
    sp: SequenceParallel  # this rank's SP group: the Ulysses all-to-alls of its TP slice
    tp: TensorParallel  # this rank's TP group: consecutive ranks

    @classmethod
    def whole(cls, world: SequenceParallel) -> Mesh:
        """No tensor parallelism: the whole group is the SP group."""
        return cls(world, TensorParallel())

    @classmethod
    def build(cls, world: SequenceParallel, tp_degree: int, timeout_s: float) -> Mesh:
        """Split `world` into TP groups of tp_degree consecutive ranks. Every rank of `world` must call it alike
        (each creates every subgroup, in the same order). tp_degree 1 makes no group: SP is `world` itself."""
        if tp_degree == 1:
            return cls.whole(world)
        if world.degree % tp_degree:
            raise ValueError(f"tp_degree={tp_degree} does not divide the group's {world.degree} ranks")
        grid = RankGrid(tp_degree, world.degree // tp_degree)
        timeout = datetime.timedelta(seconds=timeout_s)
        rank = dist.get_rank()
        tp_group = sp_group = None
        for ranks in grid.tp_groups():
            group = dist.new_group(ranks, timeout=timeout)
            tp_group = group if rank in ranks else tp_group
        if grid.sp > 1:
            for ranks in grid.sp_groups():
                group = dist.new_group(ranks, timeout=timeout)
                sp_group = group if rank in ranks else sp_group
        return cls(SequenceParallel(sp_group), TensorParallel(tp_group))
