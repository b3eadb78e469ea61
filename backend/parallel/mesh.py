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
    def whole(cls, group: SequenceParallel) -> Mesh:
        """No tensor parallelism: the whole group is the SP group."""
        return cls(group, TensorParallel())

    @classmethod
    def build(cls, group: SequenceParallel, tp_degree: int, timeout_s: float) -> Mesh:
        """Split `group` into TP groups of tp_degree consecutive ranks. Every rank of `group` must call it alike
        (each creates every subgroup, in the same order). tp_degree 1 makes no group: SP is `group` itself."""
        if tp_degree == 1:
            return cls.whole(group)
        if group.degree % tp_degree:
            raise ValueError(f"tp_degree={tp_degree} does not divide the group's {group.degree} ranks")
        grid = RankGrid(tp_degree, group.degree // tp_degree)
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
