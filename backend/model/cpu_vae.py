"""The Wan VAE's float32 CPU fast path, for its decoder (each block's frames) and its encoder (the first-frame
condition): the same convolutions, about 5x faster (bench/README section 16). `cpu_vae_kernels=torch` keeps
torch's own kernels.

torch sends a float32 Conv3d to its slow unfold-and-GEMM kernel (`slow_conv3d_forward`) whenever
N * C * T * H < 20480, a threshold written for 4D images that a batch-1 video block never reaches: at the demo's
128x128 the decoder spent ~84 % of a block there, and the condition encode, inside every DiT block, 83 % of the
block. Here every 3D convolution calls oneDNN directly on activations and weights in `channels_last_3d` (channels
innermost: oneDNN's own layout, so it reorders nothing), and every RMS norm takes its norm as the square root of a
sum of squares, a plain reduction over the innermost axis, in place of `linalg_vector_norm`, which strides across
the channels (~8 %). Both compute the same sums in another order: frames and condition latents agree with torch's
default path to float32 rounding (tests/test_cpu_vae.py). The condition latents are the DiT's input, so a
block's latents differ from a server on torch's kernels in their last bits: a recording made on those (every
server before the encoder's fast path) replays bit for bit on `cpu_vae_kernels=torch` (docs/replay.md).

The activations stay channels-last from the first convolution on (elementwise ops, padding, concatenation,
the feature cache's clones and nearest upsampling all keep the layout), so the split decoder's bands and halos
run on the same path.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d, WanRMS_norm

CHANNELS_LAST = torch.channels_last_3d
NORM_EPS = 1e-12  # F.normalize's


def use_fast_cpu_path(device: torch.device, *parts: torch.nn.Module) -> None:
    """Switch VAE parts' (the encoder's, the decoder's) 3D convolutions and RMS norms to the fast path, in place,
    where it applies: float32 on CPU with oneDNN (torch already routes bfloat16 CPU convolutions to oneDNN). Once
    is enough."""
    dtype = next(parts[0].parameters()).dtype
    if device.type != "cpu" or dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return
    # diffusers at a VAE's load, not at the engine's import (tests/test_rooms)
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d, WanRMS_norm

    for module in (m for part in parts for m in part.modules()):
        if isinstance(module, WanCausalConv3d):
            _onednn_conv(module)
        elif isinstance(module, WanRMS_norm):
            module.forward = _sum_of_squares_norm(module)


def _onednn_conv(conv: WanCausalConv3d) -> None:
    conv.weight.data = conv.weight.data.contiguous(memory_format=CHANNELS_LAST)
    padding, stride, dilation, groups = list(conv.padding), list(conv.stride), list(conv.dilation), conv.groups

    def conv_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x = x.contiguous(memory_format=CHANNELS_LAST)
        return torch.mkldnn_convolution(x, weight, bias, padding, stride, dilation, groups)

    conv._conv_forward = conv_forward  # what nn.Conv3d.forward calls, on the whole-frame and band paths alike


def _sum_of_squares_norm(norm: WanRMS_norm):
    axis = 1 if norm.channel_first else -1

    def forward(x: torch.Tensor) -> torch.Tensor:
        length = x.square().sum(axis, keepdim=True).sqrt().clamp_min(NORM_EPS)
        return (x / length) * norm.scale * norm.gamma + norm.bias

    return forward
