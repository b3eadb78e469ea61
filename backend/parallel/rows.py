"""Image rows split across the ranks of a group: each rank holds one band (rank order, top to bottom).

The VAE decoder runs band by band (model/split_decoder): a 3x3 convolution needs one row of each
neighbour's band (its halo), a spatial attention needs every row, and the owner of a stream needs the
whole frames. Bands are balanced at the latent resolution (sizes differ by at most one row) and scale
with every 2x upsampling, so a band's size at any resolution is its latent rows times the same factor.

The exchanges go through their own gloo group on CPU tensors: they run on the decode sender's thread
while the group loop's forwards use the data group, and their messages are a few rows.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def band_sizes(rows: int, degree: int) -> list[int]:
    """Rows per rank, top band first: as even as possible, the larger bands on top."""
    base, extra = divmod(rows, degree)
    return [base + (r < extra) for r in range(degree)]


class RowBands:
    """One rank's view of a decode split; `sizes` are the latent rows of every rank's band."""

    def __init__(self, group: dist.ProcessGroup, latent_rows: int) -> None:
        self.group = group
        self.degree = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.sizes = band_sizes(latent_rows, self.degree)
        self.start = sum(self.sizes[: self.rank])

    def local(self, x: torch.Tensor, factor: int = 1) -> torch.Tensor:
        """This rank's band of a full-height tensor (rows on dim -2) at `factor` x the latent resolution."""
        return x[..., self.start * factor : (self.start + self.sizes[self.rank]) * factor, :]

    def factor(self, band: torch.Tensor) -> int:
        """The resolution of this rank's `band`, as a multiple of the latent resolution."""
        factor, rest = divmod(band.shape[-2], self.sizes[self.rank])
        if rest:
            raise ValueError(f"a band of {band.shape[-2]} rows is not a multiple of {self.sizes[self.rank]} latent rows")
        return factor

    def halo(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        """The band with `rows` rows of each neighbour's band above and below; zeros past the image edge
        (the zero padding the unsplit convolution applies there). Both directions travel in one batch."""
        above, below = (torch.zeros((*x.shape[:-2], rows, x.shape[-1]), dtype=x.dtype) for _ in range(2))
        ops = []
        if self.rank > 0:
            ops += [self._send(x[..., :rows, :], self.rank - 1), self._recv(above, self.rank - 1)]
        if self.rank < self.degree - 1:
            ops += [self._send(x[..., -rows:, :], self.rank + 1), self._recv(below, self.rank + 1)]
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()
        return torch.cat([above.to(x.device), x, below.to(x.device)], dim=-2)

    def all_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's band of the same tensor, stacked into the full height, on every rank."""
        sizes = self._scaled(x)
        mine = _padded(x, max(sizes))
        parts = [torch.empty_like(mine) for _ in sizes]
        dist.all_gather(parts, mine, group=self.group)
        return torch.cat([p[..., :n, :] for p, n in zip(parts, sizes)], dim=-2).to(x.device)

    def gather(self, x: torch.Tensor, dst: int) -> torch.Tensor | None:
        """The full height on rank `dst` (None elsewhere)."""
        sizes = self._scaled(x)
        mine = _padded(x, max(sizes))
        parts = [torch.empty_like(mine) for _ in sizes] if self.rank == dst else None
        dist.gather(mine, parts, group_dst=dst, group=self.group)
        if parts is None:
            return None
        return torch.cat([p[..., :n, :] for p, n in zip(parts, sizes)], dim=-2)

    def _scaled(self, band: torch.Tensor) -> list[int]:
        """Every rank's band rows at the resolution of this rank's `band`."""
        factor = self.factor(band)
        return [n * factor for n in self.sizes]

    def _send(self, rows: torch.Tensor, peer: int) -> dist.P2POp:
        return dist.P2POp(dist.isend, rows.contiguous().cpu(), group=self.group, group_peer=peer)

    def _recv(self, into: torch.Tensor, peer: int) -> dist.P2POp:
        return dist.P2POp(dist.irecv, into, group=self.group, group_peer=peer)


def _padded(x: torch.Tensor, rows: int) -> torch.Tensor:
    x = x.contiguous().cpu()
    if x.shape[-2] == rows:
        return x
    pad = x.new_zeros((*x.shape[:-2], rows - x.shape[-2], x.shape[-1]))
    return torch.cat([x, pad], dim=-2)
