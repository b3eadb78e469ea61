"""Wan VAE decode: each AR block decoded causally, as it is produced, with a per-session feature cache;
split by image rows across the ranks of a decode group when there is one (see split_decoder)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ..parallel.rows import RowBands
from . import cpu_vae
from .split_decoder import SplitDecoder


@dataclass
class DecodeState:
    """The causal decoder's per-session feature cache: blocks decoded one after another stream seamlessly."""

    feature_cache: list  # of this rank's band of rows when the decode is split
    decoded_latent_frames: int = 0


class StreamingVae:
    def __init__(self, vae: torch.nn.Module, device: torch.device, group: dist.ProcessGroup | None = None,
                 fast_cpu: bool = True) -> None:
        """group: the ranks that share each block's decode (see RowBands); None decodes whole frames.
        fast_cpu: a float32 decode on CPU takes cpu_vae's path (False keeps torch's default kernels)."""
        self.vae = vae
        if fast_cpu:
            cpu_vae.use_fast_cpu_path(device, vae.post_quant_conv, vae.decoder)
        self.device = device
        self.group = group
        self.split = SplitDecoder(vae.decoder) if group is not None else None
        z = vae.config.z_dim
        self.mean = torch.tensor(vae.config.latents_mean, dtype=torch.float32, device=device).view(1, z, 1, 1, 1)
        std = torch.tensor(vae.config.latents_std, dtype=torch.float32, device=device).view(1, z, 1, 1, 1)
        self.inv_std = 1.0 / std  # the reference's scale[1]: it decodes z / (1 / std) + mean, bit for bit
        # diffusers at a VAE's load, not at the engine's import (tests/test_rooms)
        from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

        self._conv_count = sum(isinstance(m, WanCausalConv3d) for m in vae.decoder.modules())
        # Decoding runs on the decode sender's thread: a side stream lets it overlap the DiT on GPU.
        self._decode_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @property
    def dtype(self) -> torch.dtype:
        return next(self.vae.parameters()).dtype

    def new_decode_state(self) -> DecodeState:
        return DecodeState(feature_cache=[None] * self._conv_count)

    def splits(self, latent_rows: int) -> bool:
        """Whether blocks of this height are decoded in bands: every rank needs at least one latent row."""
        return self.group is not None and latent_rows >= dist.get_world_size(self.group)

    def band(self, latent_rows: int) -> tuple[int, int]:
        """This rank's latent rows [first, end) when blocks of this height are decoded in bands (`splits`)."""
        bands = RowBands(self.group, latent_rows)
        return bands.start, bands.start + bands.sizes[bands.rank]

    @torch.no_grad()
    def decode_block(self, latents: torch.Tensor, state: DecodeState, owner: int = 0) -> np.ndarray | None:
        """Normalised latents [1, z, F, h, w] of the next block -> uint8 frames [n, H, W, 3] on rank `owner`.

        With a decode group every rank calls it for the same blocks in the same order; each decodes its
        band, and the frames come back on `owner` (None on the others). Without one it decodes alone.
        """
        bands = RowBands(self.group, latents.shape[-2]) if self.splits(latents.shape[-2]) else None
        if bands is None and self.group is not None and dist.get_rank(self.group) != owner:
            return None  # too few rows to split: the owner decodes alone
        side = torch.cuda.stream(self._decode_stream) if self._decode_stream else contextlib.nullcontext()
        split = self.split.bands(bands) if bands is not None else contextlib.nullcontext()
        with side, split:
            x = latents.to(self.device).float()
            if bands is not None:
                x = bands.local(x)
            x = self.vae.post_quant_conv((x / self.inv_std + self.mean).to(self.dtype))
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
            video = torch.cat(outs, dim=2).clamp(-1.0, 1.0)[0]  # [3, n, H or band, W]
            frames = ((video.float() + 1.0) * 127.5).round().to(torch.uint8).cpu()  # .cpu() waits for the stream
        if bands is not None:
            frames = bands.gather(frames, owner)
            if frames is None:
                return None
        return frames.permute(1, 2, 3, 0).numpy()
