"""How large a session's decoder and condition-encoder states grow, from dry runs on the meta device (shapes only,
no memory, no arithmetic): the bytes a snapshot of them takes, known before it is written.

The causal Wan VAE keeps the last frames of every causal convolution's input (diffusers' `feat_cache`); its size
depends on the architecture and the frame size only, and stops growing after the first chunks. The tiny decoder
keeps one frame per memory block. Each function runs the module's own code, so it follows whatever the
architecture is, and returns the largest state over the first `CHUNKS` chunks with its count of tensors.
"""
from __future__ import annotations

import functools
import json
from collections.abc import Iterable

import torch

from .tiny_vae import LATENT_CHANNELS, TinyDecoder

CHUNKS = 4  # a cache is full after the second chunk (a temporal downsample's after the third); one more to be sure
ENCODER_CHUNK_FRAMES = 4  # frames of each condition chunk after the image (model/condition)


def vae_decoder_state(vae_config: dict, latent_height: int, latent_width: int) -> tuple[int, int]:
    """(bytes, tensors) of the Wan VAE decoder's feature cache for frames of this latent size (float32)."""
    return _vae_states(json.dumps(dict(vae_config), sort_keys=True), latent_height, latent_width)[0]


def condition_encoder_state(vae_config: dict, height: int, width: int) -> tuple[int, int]:
    """(bytes, tensors) of the condition encoder's feature cache for an image of this size (float32)."""
    factor = 2 ** (len(vae_config["dim_mult"]) - 1)
    return _vae_states(json.dumps(dict(vae_config), sort_keys=True), height // factor, width // factor)[1]


def tiny_decoder_state(latent_height: int, latent_width: int) -> tuple[int, int]:
    """(bytes, tensors) of the tiny decoder's memory (its memory blocks' last input frames, float32)."""
    with torch.device("meta"):
        decoder = TinyDecoder()
        memory: dict[int, torch.Tensor] = {}
        decoder(torch.empty(2, LATENT_CHANNELS, latent_height, latent_width), memory)
    return _bytes(memory.values()), len(memory)


@functools.lru_cache(maxsize=16)
def _vae_states(config_json: str, latent_height: int, latent_width: int) -> tuple[tuple[int, int], tuple[int, int]]:
    # diffusers at a VAE's load, not at the engine's import (tests/test_rooms)
    from diffusers import AutoencoderKLWan

    config = {k: v for k, v in json.loads(config_json).items() if not k.startswith("_")}
    factor = 2 ** (len(config["dim_mult"]) - 1)
    with torch.device("meta"):
        vae = AutoencoderKLWan(**config)
        decoder_cache = [None] * _convs(vae.decoder)
        encoder_cache = [None] * _convs(vae.encoder)
        decoder_most = encoder_most = (0, 0)
        for chunk in range(CHUNKS):
            latent = torch.empty(1, vae.config.z_dim, 1, latent_height, latent_width)
            vae.decoder(vae.post_quant_conv(latent), feat_cache=decoder_cache, feat_idx=[0], first_chunk=chunk == 0)
            decoder_most = max(decoder_most, (_bytes(decoder_cache), _count(decoder_cache)))
            frames = 1 if chunk == 0 else ENCODER_CHUNK_FRAMES
            image = torch.empty(1, 3, frames, latent_height * factor, latent_width * factor)
            vae.encoder(image, feat_cache=encoder_cache, feat_idx=[0])
            encoder_most = max(encoder_most, (_bytes(encoder_cache), _count(encoder_cache)))
    return decoder_most, encoder_most


def _convs(module: torch.nn.Module) -> int:
    return sum(type(m).__name__ == "WanCausalConv3d" for m in module.modules())


def _bytes(tensors: Iterable[object]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _count(tensors: Iterable[object]) -> int:
    return sum(isinstance(t, torch.Tensor) for t in tensors)
