"""3D rotary position tables (frame, height, width) at absolute frame positions, as in Wan."""
from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed


class RotaryTables:
    """Per-token cos/sin for a block of frames; the frequencies are diffusers' Wan tables."""

    def __init__(self, head_dim: int, max_frames: int, device: torch.device) -> None:
        rope = WanRotaryPosEmbed(head_dim, (1, 2, 2), max_frames)
        sizes = [rope.t_dim, rope.h_dim, rope.w_dim]
        # Pairs (2i, 2i+1) share one frequency: keep one value per pair.
        self._cos = [c[:, 0::2].float().to(device) for c in rope.freqs_cos.split(sizes, dim=1)]
        self._sin = [s[:, 1::2].float().to(device) for s in rope.freqs_sin.split(sizes, dim=1)]

    def block(self, first_frame: int, frames: int, grid_h: int, grid_w: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [frames * grid_h * grid_w, head_dim / 2], tokens frame-major."""
        shape = (frames, grid_h, grid_w)
        tables = []
        for parts in (self._cos, self._sin):
            t = parts[0][first_frame : first_frame + frames]
            h = parts[1][:grid_h]
            w = parts[2][:grid_w]
            full = torch.cat(
                [
                    t[:, None, None, :].expand(*shape, -1),
                    h[None, :, None, :].expand(*shape, -1),
                    w[None, None, :, :].expand(*shape, -1),
                ],
                dim=-1,
            )
            tables.append(full.reshape(frames * grid_h * grid_w, -1))
        return tables[0], tables[1]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of x [B, L, H, D] by per-token angles cos/sin [B, L, D/2]."""
    pairs = x.float().unflatten(-1, (-1, 2))
    x1, x2 = pairs[..., 0], pairs[..., 1]
    cos = cos[:, :, None, :]
    sin = sin[:, :, None, :]
    out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)
    return out.type_as(x)
