"""3D rotary positions (frame, height, width) at absolute frame indices, as the reference computes them.

Tables are float64 by default, as the reference rotates q and k in float64 before casting back.
"""
from __future__ import annotations

import torch


def rope_axis_pairs(head_dim: int) -> tuple[int, int, int]:
    """Complex pairs per axis (frame, height, width): 22/21/21 for head_dim 128 (44/42/42 channels)."""
    half = head_dim // 2
    return half - 2 * (half // 3), half // 3, half // 3


def rope_tables(
    head_dim: int,
    first_frame: int,
    frames: int,
    grid_h: int,
    grid_w: int,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str | None = None,
    theta: float = 10000.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [frames*grid_h*grid_w, head_dim/2] for tokens in (frame, h, w) order.

    Frame positions are absolute (first_frame = index of the block's first latent frame since the session
    start); height/width positions start at 0. Each axis uses its own frequency ladder
    theta^(-2i/axis_channels), computed in float64 as the reference does.
    """
    angles = []
    for pairs, positions in zip(
        rope_axis_pairs(head_dim),
        (torch.arange(first_frame, first_frame + frames), torch.arange(grid_h), torch.arange(grid_w)),
    ):
        inv = 1.0 / theta ** (torch.arange(pairs, dtype=torch.float64) * 2 / (2 * pairs))
        angles.append(torch.outer(positions.to(torch.float64), inv))
    shape = (frames, grid_h, grid_w)
    full = torch.cat(
        [
            angles[0][:, None, None, :].expand(*shape, -1),
            angles[1][None, :, None, :].expand(*shape, -1),
            angles[2][None, None, :, :].expand(*shape, -1),
        ],
        dim=-1,
    ).reshape(frames * grid_h * grid_w, -1)
    return full.cos().to(dtype=dtype, device=device), full.sin().to(dtype=dtype, device=device)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (2i, 2i+1) of x [B, L, H, D] by cos/sin [B, L, D/2]; math in the tables' dtype."""
    pairs = x.to(cos.dtype).unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    return torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(-2).to(x.dtype)
