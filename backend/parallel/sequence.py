"""The Ulysses exchanges: sequence shards <-> head shards with all-to-all, on one rank's view of the group."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class CommStats:
    """Bytes this rank sent through all-to-all since the last reset (the engine resets it per block)."""

    all_to_all_bytes: int = 0

    def reset(self) -> None:
        self.all_to_all_bytes = 0


class SequenceParallel:
    """One rank's view of the sequence-parallel group; degree 1 makes every exchange the identity."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.degree = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        self.stats = CommStats()

    def shard(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's contiguous slice of `dim` (sequence order is rank order)."""
        if self.degree == 1:
            return x
        return x.chunk(self.degree, dim=dim)[self.rank].contiguous()

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """x as rank `src` holds it, on every rank (in place)."""
        if self.degree > 1:
            dist.broadcast(x, group_src=src, group=self.group)
        return x

    def all_true(self, flag: bool, device: torch.device) -> bool:
        """Whether `flag` holds on every rank (a collective; `device`: where this group's tensors live)."""
        if self.degree == 1:
            return flag
        agreed = torch.tensor([int(flag)], dtype=torch.int32, device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=self.group)
        return bool(agreed.item())

    def head_slice(self, num_heads: int) -> slice:
        local = num_heads // self.degree
        return slice(self.rank * local, (self.rank + 1) * local)

    def seq_to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[..., L/sp, H, D] sequence shard -> [..., L, H/sp, D] head shard."""
        if self.degree == 1:
            return x
        *lead, local_len, heads, dim = x.shape
        sp = self.degree
        # chunk j (heads j*H/sp ...) goes to rank j; received chunk i holds rank i's tokens.
        send = x.reshape(*lead, local_len, sp, heads // sp, dim).movedim(-3, 0).contiguous()
        recv = self._all_to_all(send)
        return recv.movedim(0, -4).reshape(*lead, sp * local_len, heads // sp, dim)

    def heads_to_seq(self, x: torch.Tensor) -> torch.Tensor:
        """[..., L, H/sp, D] head shard -> [..., L/sp, H, D] sequence shard."""
        if self.degree == 1:
            return x
        *lead, length, local_heads, dim = x.shape
        sp = self.degree
        send = x.reshape(*lead, sp, length // sp, local_heads, dim).movedim(-4, 0).contiguous()
        recv = self._all_to_all(send)  # recv[i]: our tokens, heads of rank i
        return recv.movedim(0, -3).reshape(*lead, length // sp, sp * local_heads, dim)

    def gather_seq(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Concatenate every rank's sequence shard along `dim`."""
        if self.degree == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.degree)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)

    def _all_to_all(self, send: torch.Tensor) -> torch.Tensor:
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        # Bytes that leave this rank: every chunk but the one it keeps.
        self.stats.all_to_all_bytes += send.numel() * send.element_size() * (self.degree - 1) // self.degree
        return recv
