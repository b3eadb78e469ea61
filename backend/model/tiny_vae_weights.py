"""Write random weights in the published layout of the TAEHV tiny autoencoder for Wan 2.1 (`taew2_1.pth`): every
key and shape of its state dict, the encoder's included (the server reads only the decoder's), since the real file
cannot be downloaded here.

    python -m backend.model.tiny_vae_weights OUT.pth [--seed 0]      # or OUT.safetensors

The names and shapes follow taehv.py's module structure for Wan 2.1 (patch size 1, 16 latent channels, time
pooled by 2 twice in the encoder, grown by 2 twice in the decoder). Weights are normal with std 0.7 / sqrt(fan-in)
and biases 0.1: scaled so that random frames keep contrast (He's std saturates half the values at 0 or 255); they
decode noise.
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
from torch import nn

from .tiny_vae import LATENT_CHANNELS, MemoryBlock, TinyDecoder, conv3x3

ENCODER_WIDTH = 64
ENCODER_TIME_STRIDES = (2, 2, 1)
WEIGHT_GAIN = 0.7
BIAS = 0.1


def time_pool(channels: int, stride: int) -> nn.Module:
    """The encoder's time pool: `stride` frames' channels side by side, a bias-free 1x1 conv to `channels`."""
    pool = nn.Module()
    pool.conv = nn.Conv2d(channels * stride, channels, 1, bias=False)
    return pool


def encoder_layers() -> nn.Sequential:
    """The encoder's layers at their published indices (only their parameters matter here)."""
    width = ENCODER_WIDTH
    layers: list[nn.Module] = [conv3x3(3, width), nn.ReLU()]
    for stride in ENCODER_TIME_STRIDES:
        layers += [time_pool(width, stride), nn.Conv2d(width, width, 3, stride=2, padding=1, bias=False)]
        layers += [MemoryBlock(width) for _ in range(3)]
    layers.append(conv3x3(width, LATENT_CHANNELS))
    return nn.Sequential(*layers)


def published_layout() -> dict[str, torch.Size]:
    """Every key of `taew2_1.pth` with its shape."""
    with torch.device("meta"):
        state = {f"encoder.{k}": v for k, v in encoder_layers().state_dict().items()}
        state.update(TinyDecoder().state_dict())
    return {name: tensor.shape for name, tensor in state.items()}


def random_state(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in published_layout().items():
        if name.endswith(".bias"):
            state[name] = torch.full(shape, BIAS)
        else:
            fan_in = math.prod(shape[1:])
            state[name] = torch.randn(shape, generator=generator) * (WEIGHT_GAIN / math.sqrt(fan_in))
    return state


def write_weights(out: Path, seed: int = 0) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    state = random_state(seed)
    if out.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(state, str(out))
    else:
        torch.save(state, out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(write_weights(args.out, args.seed))


if __name__ == "__main__":
    main()
