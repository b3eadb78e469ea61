"""FLOP of one DiT forward as a function of the geometry (2 FLOP per multiply-add, matrix products only).

For the 14B model at 480x832 (4,680 tokens per block of 3 latent frames) over a full window of 18 frames
(28,080 keys): 151.7 TFLOP in the linear layers (camera layers included), 107.7 in self-attention, 2.0 in
cross-attention; 261.3 per forward, 1,307 per block of 5 forwards. The prompt's K/V are projected once per
session and the time embedding once per frame, so neither is counted.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from backend.model.config import TransformerConfig


@dataclass(frozen=True)
class ForwardFlops:
    linear: float  # q/k/v/o, cross q/o, FFN, camera injector and embeddings, patch embedding, head
    self_attention: float  # QK^T and PV over the window's keys
    cross_attention: float  # QK^T and PV over text_len prompt rows

    @property
    def total(self) -> float:
        return self.linear + self.self_attention + self.cross_attention


def forward_flops(cfg: TransformerConfig, tokens: int, keys: int) -> ForwardFlops:
    """One forward over `tokens` query tokens whose self-attention sees `keys` keys (the block's own included)."""
    d, layers, patch = cfg.dim, cfg.num_layers, math.prod(cfg.patch_size)
    per_layer = (
        4 * d * d  # self-attention q, k, v, o
        + 2 * d * d  # cross-attention q, o
        + 4 * d * d  # camera injector layers 1, 2, scale, shift
        + 2 * d * cfg.ffn_dim  # FFN up, down
    )
    outside = (
        cfg.in_dim * patch * d  # patch embedding
        + cfg.camera_dim * d + 2 * d * d  # camera patch embedding and its two-layer MLP
        + d * cfg.out_dim * patch  # head
    )
    return ForwardFlops(
        linear=2.0 * tokens * (layers * per_layer + outside),
        self_attention=4.0 * tokens * keys * d * layers,
        cross_attention=4.0 * tokens * cfg.text_len * d * layers,
    )


def block_keys(block_index: int, block_frames: int, window_frames: int, tokens_per_frame: int) -> int:
    """Self-attention keys of every forward of block `block_index`: its history in the window plus itself."""
    return min((block_index + 1) * block_frames, window_frames) * tokens_per_frame
