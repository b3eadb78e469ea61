"""Random models made straight on the device, with no checkpoint on disk: the real geometry for benchmarks.

The transformer is built on the meta device, then each tensor is allocated in the serving dtype on its device
and filled in place (norm scales 1, biases 0, every other tensor normal with std 0.02), one at a time: no
float32 copy of the model exists anywhere. The VAE is a randomly initialised `AutoencoderKLWan` built on the
device in float32, and the prompt encoder a stand-in that returns random states of the encoder's shape.
"""
from __future__ import annotations

import torch

from .checkpoint import assign
from .config import TransformerConfig
from .transformer import LingBotTransformer

# The Wan 2.1 VAE that LingBot-World v2 decodes with (diffusers `AutoencoderKLWan`).
WAN21_VAE = dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, temperal_downsample=[False, True, True])


def random_transformer(
    config: TransformerConfig, dtype: torch.dtype, device: torch.device, seed: int = 0, std: float = 0.02
) -> LingBotTransformer:
    """The DiT of `config` with deterministic random weights in `dtype`, made tensor by tensor on `device`."""
    with torch.device("meta"):
        model = LingBotTransformer(config)
    generator = torch.Generator(device).manual_seed(seed)
    for name, param in list(model.named_parameters()):
        value = torch.empty(param.shape, dtype=dtype, device=device)
        if name.endswith("bias"):
            value.zero_()
        elif "norm" in name:  # RMSNorm / LayerNorm scales
            value.fill_(1.0)
        else:
            value.normal_(0.0, std, generator=generator)
        assign(model, name, value)
    return model.eval().requires_grad_(False)


def random_vae(architecture: dict, device: torch.device, seed: int = 0) -> torch.nn.Module:
    """`AutoencoderKLWan(**architecture)` in float32 with its default random init, built on `device`;
    latents normalised by mean 0 and std 1."""
    from diffusers import AutoencoderKLWan

    z = architecture["z_dim"]
    torch.manual_seed(seed)
    with torch.device(device):
        vae = AutoencoderKLWan(**architecture, latents_mean=[0.0] * z, latents_std=[1.0] * z)
    return vae.eval().requires_grad_(False)


class RandomPromptStates:
    """Stand-in for the umT5 encoder: the same random states [1, text_len, text_dim] for every prompt."""

    def __init__(self, text_len: int, text_dim: int, dtype: torch.dtype, device: torch.device, seed: int = 0) -> None:
        self.shape = (1, text_len, text_dim)
        self.dtype = dtype
        self.device = device
        self.seed = seed

    def encode(self, prompt: str) -> torch.Tensor:
        generator = torch.Generator(self.device).manual_seed(self.seed)
        return torch.randn(self.shape, generator=generator, dtype=self.dtype, device=self.device)
