"""FLOP of one DiT forward as a function of the geometry (2 FLOP per multiply-add, matrix products only).

For the 14B model at 480x832 (4,680 tokens per block of 3 latent frames) over a full window of 18 frames
(28,080 keys): 111.9 TFLOP in the linear layers, 39.8 in the camera branch, 107.7 in self-attention, 2.0 in
cross-attention; 261.3 per forward. The camera branch depends on the block's camera alone and runs once a block
(transformer.CameraModulation), so a block of 5 forwards is 1,147 TFLOP (the reference, which runs it in every
forward: 1,307). The prompt's K/V are projected once per session and the time embedding once per frame, so
neither is counted.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from backend.model.config import TransformerConfig


@dataclass(frozen=True)
class ForwardFlops:
    linear: float  # q/k/v/o, cross q/o, FFN, patch embedding, head
    camera: float  # camera embedding and MLP, each layer's camera injector and scale/shift layers
    self_attention: float  # QK^T and PV over the window's keys
    cross_attention: float  # QK^T and PV over text_len prompt rows

    @property
    def total(self) -> float:
        """A forward that makes its block's camera modulation (the block's first; every forward of the reference)."""
        return self.linear + self.camera + self.self_attention + self.cross_attention

    def block(self, forwards: int) -> float:
        """A block of `forwards` forwards of this cost: the camera branch once, the rest in every forward."""
        return forwards * self.total - (forwards - 1) * self.camera


def forward_flops(cfg: TransformerConfig, tokens: int, keys: int) -> ForwardFlops:
    """One forward over `tokens` query tokens whose self-attention sees `keys` keys (the block's own included)."""
    d, layers, patch = cfg.dim, cfg.num_layers, math.prod(cfg.patch_size)
    per_layer = (
        4 * d * d  # self-attention q, k, v, o
        + 2 * d * d  # cross-attention q, o
        + 2 * d * cfg.ffn_dim  # FFN up, down
    )
    outside = cfg.in_dim * patch * d + d * cfg.out_dim * patch  # patch embedding, head
    camera = (
        layers * 4 * d * d  # each layer's camera injector layers 1, 2, scale, shift
        + cfg.camera_dim * d + 2 * d * d  # camera patch embedding and its two-layer MLP
    )
    return ForwardFlops(
        linear=2.0 * tokens * (layers * per_layer + outside),
        camera=2.0 * tokens * camera,
        self_attention=4.0 * tokens * keys * d * layers,
        cross_attention=4.0 * tokens * cfg.text_len * d * layers,
    )


def block_keys(block_index: int, block_frames: int, window_frames: int, tokens_per_frame: int) -> int:
    """Self-attention keys of every forward of block `block_index`: its history in the window plus itself."""
    return min((block_index + 1) * block_frames, window_frames) * tokens_per_frame
