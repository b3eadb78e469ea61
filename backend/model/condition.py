"""The first-frame condition, streamed: the causal Wan VAE encoder runs block by block, just ahead of the DiT.

As in the reference, the condition video is the image (scaled to [-1, 1], then bicubic-resized to the output
size) followed by zero frames (0 in [-1, 1]: mid grey), encoded to the normalised distribution mean; the mask
has 4 channels, 1 on latent frame 0 only; the model's input is [noisy z, mask 4, condition z]. Encoding frame by
frame with the encoder's feature cache (the image alone, then 4 zero frames per latent frame, as
`AutoencoderKLWan._encode` chunks a clip) gives the whole-clip encode bit for bit, so the first block pays for
its own frames only. Once the encoder reaches a fixed point on zero frames (its output latent and its whole
feature cache unchanged by another chunk), that latent is reused and the cache freed.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from . import cpu_vae

MASK_CHANNELS = 4


def prepare_image(image: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """uint8 [H, W, 3] -> float32 [3, height, width]: scaled to [-1, 1], then bicubic (no antialias, no clamp)."""
    x = image.permute(2, 0, 1).float().div(255.0).sub(0.5).div(0.5)
    return F.interpolate(x[None], size=(height, width), mode="bicubic")[0]


def condition_mask(first_frame: int, frames: int, height: int, width: int, device: torch.device) -> torch.Tensor:
    """[1, 4, frames, h, w] of the latent frames first_frame..: 1 on latent frame 0, 0 elsewhere."""
    mask = torch.zeros((1, MASK_CHANNELS, frames, height, width), device=device)
    if first_frame == 0:
        mask[:, :, 0] = 1.0
    return mask


@dataclass
class ConditionState:
    """One session's encoder position: the feature cache until the fixed point, then the reused latent."""

    image: torch.Tensor  # [1, 3, 1, H, W] in the VAE's dtype and device
    feature_cache: list | None
    encoded_frames: int = 0  # latent frames produced so far
    previous: torch.Tensor | None = None  # the last zero chunk's latent, while probing for the fixed point
    steady: torch.Tensor | None = None  # [1, z, 1, h, w] once the encoder is at its fixed point
    zero_chunks: int = 0
    stats: dict = field(default_factory=lambda: {"encoded": 0, "reused": 0})


class StreamingConditionEncoder:
    def __init__(self, vae: torch.nn.Module, max_probe_chunks: int = 64, fast_cpu: bool = True) -> None:
        """max_probe_chunks: zero chunks after which the fixed-point check stops (a tiny random VAE reaches it
        after about 22, the Wan 2.1 architecture with random weights after about 30); encoding goes on.
        fast_cpu: a float32 encode on CPU takes cpu_vae's path (False keeps torch's default kernels)."""
        self.vae = vae
        param = next(vae.parameters())
        if fast_cpu:
            cpu_vae.use_fast_cpu_path(param.device, vae.encoder, vae.quant_conv)
        self.max_probe_chunks = max_probe_chunks
        z = vae.config.z_dim
        self.mean = torch.tensor(vae.config.latents_mean, dtype=param.dtype, device=param.device).view(1, z, 1, 1, 1)
        self.inv_std = 1.0 / torch.tensor(vae.config.latents_std, dtype=param.dtype, device=param.device).view(
            1, z, 1, 1, 1
        )
        self._convs = sum(type(m).__name__ == "WanCausalConv3d" for m in vae.encoder.modules())

    def start(self, image: torch.Tensor) -> ConditionState:
        """image: float [3, H, W] from `prepare_image`."""
        param = next(self.vae.parameters())
        return ConditionState(image=image.to(param.device, param.dtype)[None, :, None], feature_cache=[None] * self._convs)

    @torch.no_grad()
    def encode_next(self, state: ConditionState, latent_frames: int) -> torch.Tensor:
        """The next latent frames of the condition: [1, z, latent_frames, h, w] (normalised mean, VAE dtype)."""
        return torch.cat([self._next(state) for _ in range(latent_frames)], dim=2)

    def _next(self, state: ConditionState) -> torch.Tensor:
        state.encoded_frames += 1
        if state.steady is not None:
            state.stats["reused"] += 1
            return state.steady
        first = state.encoded_frames == 1
        x = state.image if first else state.image.new_zeros((*state.image.shape[:2], 4, *state.image.shape[3:]))
        before = list(state.feature_cache)  # the encoder replaces entries, it does not mutate them
        out = self.vae.encoder(x, feat_cache=state.feature_cache, feat_idx=[0])
        latent = (self.vae.quant_conv(out)[:, : self.vae.config.z_dim] - self.mean) * self.inv_std
        state.stats["encoded"] += 1
        if not first:
            state.zero_chunks += 1
            if state.zero_chunks <= self.max_probe_chunks:
                if (state.previous is not None and torch.equal(latent, state.previous)
                        and _same_cache(state.feature_cache, before)):
                    state.steady, state.feature_cache, state.previous = latent, None, None
                else:
                    state.previous = latent
            else:
                state.previous = None
        return latent


def _same_cache(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        (x is y) or (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and torch.equal(x, y))
        for x, y in zip(a, b)
    )
