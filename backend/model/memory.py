"""Bytes per rank in closed form: the transformer's weights under tensor parallelism, one session's caches.

Independent of the modules (tests compare them with what a rank actually holds); bench/engine and
docs/parallelism.md print them for the published 14B config.
"""
from __future__ import annotations

import math

from .config import TransformerConfig


def split_parameters(cfg: TransformerConfig) -> int:
    """Parameters of one block that tensor parallelism splits tp ways: q/k/v/o of both attentions (12 D^2 with
    the camera layers' 4 D^2), q/k/v biases and qk-norm weights, the FFN's two weights and first bias, the
    camera injector's first bias and the camera scale/shift biases."""
    d, f = cfg.dim, cfg.ffn_dim
    attention = 4 * d * d + 3 * d + (2 * d if cfg.qk_norm else 0)
    return 2 * attention + 2 * d * f + f + 4 * d * d + 3 * d


def replicated_block_parameters(cfg: TransformerConfig) -> int:
    """Parameters of one block every TP rank holds whole: the row-parallel biases (both o, FFN out, camera
    injector out), the modulation table, norm3."""
    d = cfg.dim
    return 4 * d + 6 * d + (2 * d if cfg.cross_attn_norm else 0)


def replicated_outer_parameters(cfg: TransformerConfig) -> int:
    """Parameters outside the blocks, all replicated: patch and camera embeddings, the camera MLP (c2ws), text
    and time embeddings, time projection, head."""
    d, patch = cfg.dim, math.prod(cfg.patch_size)
    linear = lambda n_in, n_out: n_in * n_out + n_out  # noqa: E731
    return (
        linear(cfg.in_dim * patch, d) + linear(cfg.camera_dim, d) + 2 * linear(d, d)
        + linear(cfg.text_dim, d) + linear(d, d) + linear(cfg.freq_dim, d) + linear(d, d) + linear(d, 6 * d)
        + linear(d, cfg.out_dim * patch) + 2 * d
    )


def weight_parameters(cfg: TransformerConfig, tp: int = 1) -> int:
    """Parameters one rank holds at TP degree tp."""
    per_block = split_parameters(cfg) // tp + replicated_block_parameters(cfg)
    return cfg.num_layers * per_block + replicated_outer_parameters(cfg)


def self_cache_bytes(cfg: TransformerConfig, window_tokens: int, ranks: int, itemsize: int) -> int:
    """One session's self-attention K/V window on one rank of tp x sp = `ranks`: num_heads / ranks heads."""
    return cfg.num_layers * 2 * window_tokens * (cfg.num_heads // ranks) * cfg.head_dim * itemsize


def text_cache_bytes(cfg: TransformerConfig, ranks: int, itemsize: int) -> int:
    """One session's prompt K/V (text_len rows, every layer) on one rank of tp x sp = `ranks`."""
    return self_cache_bytes(cfg, cfg.text_len, ranks, itemsize)


def commit_record_bytes(z_dim: int, block_frames: int, latent_height: int, latent_width: int) -> int:
    """One committed block's record kept for a recache (engine/session.CommitRecord), on every rank: its
    forward's latents and condition latents [z, block_frames, h, w] and its poses [block_frames, 4, 4], all float32."""
    return (2 * z_dim * latent_height * latent_width + 16) * block_frames * 4


def camera_modulation_bytes(cfg: TransformerConfig, block_tokens: int, sp: int, tp: int, itemsize: int) -> int:
    """One session's camera modulation while its block runs (transformer.CameraModulation, made once a block and
    freed after it): every layer's (1 + scale) and shift for the rank's block_tokens / sp tokens and dim / tp
    channels, in the compute dtype."""
    return cfg.num_layers * 2 * (block_tokens // sp) * (cfg.dim // tp) * itemsize
