"""Torch threads of a CPU instance: its share of the host's cores, split between the DiT and the VAE decode.

The group loop runs a block's DiT while the decode sender decodes the previous block, each thread driving its
own OpenMP team (torch's intra-op count is per thread). Teams that together ask for more threads than the
instance has cores fight: a team's barrier waits for a member the other team preempted, while libgomp's
spinning waiters burn the cores they wait on. So the two shares add up to the instance's cores.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch


def instance_cores(instances: int) -> int:
    """Cores of one of this host's `instances` CPU model instances (SP ranks): the host's cores shared evenly."""
    return max(1, (os.cpu_count() or 1) // instances)


@dataclass(frozen=True)
class CoreSplit:
    dit: int  # the group loop's threads
    decode: int  # the decode sender's threads

    @classmethod
    def of(cls, cores: int) -> CoreSplit:
        """Half each, the DiT's half rounded down; at least one thread each (one core time-shares the two).

        Not every core for the DiT while nothing decodes: a team as wide as the cores stalls whenever any other
        thread wakes (a response send, tritonserver's own threads), one member preempted and the rest waiting at
        its barrier. bench/README (section 2, "Threads") has the measurements behind this split.
        """
        dit = max(1, cores // 2)
        return cls(dit=dit, decode=max(1, cores - dit))


def use_threads(count: int | None) -> None:
    """Set the calling thread's torch intra-op threads (its OpenMP team); None leaves them as they are."""
    if count is not None:
        # torch initialises a thread's count on its first parallel op, to the count last set by any thread:
        # initialise first, or another thread's later setting would replace this one.
        torch.get_num_threads()
        torch.set_num_threads(count)

