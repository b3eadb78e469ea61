"""Wan VAE decode: each AR block decoded causally, as it is produced, with a per-session feature cache."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch
from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d


@dataclass
class DecodeState:
    """The causal decoder's per-session feature cache: blocks decoded one after another stream seamlessly."""

    feature_cache: list
    decoded_latent_frames: int = 0


class StreamingVae:
    def __init__(self, vae: torch.nn.Module, device: torch.device) -> None:
        self.vae = vae
        self.device = device
        z = vae.config.z_dim
        self.mean = torch.tensor(vae.config.latents_mean, dtype=torch.float32, device=device).view(1, z, 1, 1, 1)
        self.std = torch.tensor(vae.config.latents_std, dtype=torch.float32, device=device).view(1, z, 1, 1, 1)
        self._conv_count = sum(isinstance(m, WanCausalConv3d) for m in vae.decoder.modules())
        # Decoding runs on the response writer's thread: a side stream lets it overlap the DiT on GPU.
        self._decode_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @property
    def dtype(self) -> torch.dtype:
        return next(self.vae.parameters()).dtype

    def new_decode_state(self) -> DecodeState:
        return DecodeState(feature_cache=[None] * self._conv_count)

    @torch.no_grad()
    def decode_block(self, latents: torch.Tensor, state: DecodeState) -> np.ndarray:
        """Normalised latents [1, z, F, h, w] of the next block -> uint8 frames [n, H, W, 3]."""
        side = torch.cuda.stream(self._decode_stream) if self._decode_stream else contextlib.nullcontext()
        with side:
            x = self.vae.post_quant_conv((latents.to(self.device).float() * self.std + self.mean).to(self.dtype))
            outs = []
            for i in range(x.shape[2]):
                outs.append(
                    self.vae.decoder(
                        x[:, :, i : i + 1],
                        feat_cache=state.feature_cache,
                        feat_idx=[0],
                        first_chunk=state.decoded_latent_frames == 0,
                    )
                )
                state.decoded_latent_frames += 1
            video = torch.cat(outs, dim=2).clamp(-1.0, 1.0)[0]  # [3, n, H, W]
            frames = ((video.float() + 1.0) * 127.5).round().to(torch.uint8)
            return frames.permute(1, 2, 3, 0).cpu().numpy()  # .cpu() waits for the side stream
