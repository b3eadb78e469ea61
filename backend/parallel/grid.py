"""Which ranks form the tensor-parallel (TP) groups and which the Ulysses (SP) groups (torch-free).

World rank r = sp_rank x tp + tp_rank: consecutive ranks form a TP group (its all-reduces are the chattiest
exchange, so they stay on one host: a server's instances hold consecutive ranks), and the ranks with the same
tp_rank form that TP slice's SP group (its all-to-alls may cross hosts). For tp = 2, sp = 2:
TP groups [0, 1] [2, 3]; SP groups [0, 2] [1, 3].
"""
from __future__ import annotations

from dataclasses import dataclass

from ..api.errors import ConfigError


@dataclass(frozen=True)
class RankGrid:
    tp: int
    sp: int

    @property
    def ranks(self) -> int:
        return self.tp * self.sp

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp

    def sp_rank(self, rank: int) -> int:
        return rank // self.tp

    def tp_groups(self) -> list[list[int]]:
        return [list(range(s * self.tp, (s + 1) * self.tp)) for s in range(self.sp)]

    def sp_groups(self) -> list[list[int]]:
        return [list(range(t, self.ranks, self.tp)) for t in range(self.tp)]

    def check_hosts(self, host_count: int) -> None:
        """Every TP group on one host: each host's instance count must be a multiple of tp."""
        per_host, left = divmod(self.ranks, host_count)
        if left or per_host % self.tp:
            raise ConfigError(
                f"tp_degree={self.tp} must divide the instances of each server ({self.ranks} instances over "
                f"host_count={host_count}): a TP group stays on one host"
            )
