"""A tiny decoder for Wan 2.1 latents: the TAEHV family's (madebyollin/taehv, weights `taew2_1.pth`), an opt-in
fast path beside the Wan VAE (setting `decoder=tiny`, `tiny_decoder_path`).

It decodes the DiT's latents as they are (no latent mean or scale) to RGB in [0, 1], one frame at a time
through 2D convolutions, causal in time: a memory block sees its own input of one frame earlier (zeros before
the first), and a time-grow layer turns each frame into `stride` frames. Its two time-grow layers of stride 2
give 4 frames per latent frame; a session's first 3 are warm-up and dropped, so a session's first block of k
latent frames gives 4k - 3 frames and every later block 4k: the Wan VAE's counts (1 + 4(k - 1), then 4k).

The layers, as `decoder.<index>` in the published state dict (the file's `encoder.*` keys are not read):

    0 soft clamp   1 conv 16->256   2 ReLU
    3-5 memory blocks 256    6 upsample 2x   7 time grow x1   8 conv 256->128 (no bias)
    9-11 memory blocks 128   12 upsample 2x  13 time grow x2  14 conv 128->64 (no bias)
    15-17 memory blocks 64   18 upsample 2x  19 time grow x2  20 conv 64->64 (no bias)
    21 ReLU   22 conv 64->3

A memory block is `relu(convs(cat(x, past)) + x)` with convs = conv 2C->C, ReLU, conv, ReLU, conv (`.conv.0`,
`.conv.2`, `.conv.4`); a time grow is a bias-free 1x1 conv C -> stride*C (`.conv`). Every conv is 3x3, padding 1,
except the time grows.

A block is decoded all its frames at once per layer (the frames are the batch); each memory block's last input
frame is kept in the session's `TinyDecodeState` for the next block, so block after block equals one whole-clip
decode. Its image quality needs the published weights (not downloadable here): only the layout, the frame counts
and the streaming are tested, on random weights (backend/model/tiny_vae_weights).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..api.errors import ConfigError
from .tiny_vae_latents import LATENT_CHANNELS, TIME_FACTOR

WARMUP_FRAMES = TIME_FACTOR - 1  # the first latent frame's frames before its last
WIDTHS = (256, 128, 64, 64)  # channels of the three stages and of the last conv's input
STAGE_TIME_STRIDES = (1, 2, 2)
MEMORY_BLOCKS_PER_STAGE = 3
CHANNELS_LAST = torch.channels_last


def conv3x3(channels_in: int, channels_out: int, bias: bool = True) -> nn.Conv2d:
    return nn.Conv2d(channels_in, channels_out, 3, padding=1, bias=bias)


class SoftClamp(nn.Module):
    """3 tanh(x / 3): latents squashed into (-3, 3)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x / 3.0) * 3.0


class MemoryBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Sequential(conv3x3(2 * channels, channels), nn.ReLU(), conv3x3(channels, channels), nn.ReLU(),
                                  conv3x3(channels, channels))

    def forward(self, x: torch.Tensor, past: torch.Tensor) -> torch.Tensor:
        """x: frames [T, C, H, W]; past: each frame's predecessor at this layer (the first's from before)."""
        return F.relu(self.conv(torch.cat([x, past], dim=1)) + x)


class TimeGrow(nn.Module):
    def __init__(self, channels: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv2d(channels, channels * stride, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[T, C, H, W] -> [T * stride, C, H, W], each frame's new frames in time order."""
        frames, channels, height, width = x.shape
        return self.conv(x).reshape(frames * self.stride, channels, height, width)


class TinyDecoder(nn.Module):
    """The decoder layers, named as the published state dict names them (`decoder.<index>...`)."""

    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = [SoftClamp(), conv3x3(LATENT_CHANNELS, WIDTHS[0]), nn.ReLU()]
        for stage, stride in enumerate(STAGE_TIME_STRIDES):
            width, next_width = WIDTHS[stage], WIDTHS[stage + 1]
            layers += [MemoryBlock(width) for _ in range(MEMORY_BLOCKS_PER_STAGE)]
            layers += [nn.Upsample(scale_factor=2), TimeGrow(width, stride), conv3x3(width, next_width, bias=False)]
        layers += [nn.ReLU(), conv3x3(WIDTHS[-1], 3)]
        self.decoder = nn.Sequential(*layers)

    def memory_layers(self) -> list[int]:
        return [i for i, layer in enumerate(self.decoder) if isinstance(layer, MemoryBlock)]

    def forward(self, latents: torch.Tensor, memory: dict[int, torch.Tensor]) -> torch.Tensor:
        """Latent frames [T, 16, h, w] -> RGB frames [4T, 3, 8h, 8w] in [0, 1]; `memory` (each memory block's
        last input frame so far, by layer index; empty at a session's start) is updated in place."""
        x = latents
        for index, layer in enumerate(self.decoder):
            if isinstance(layer, MemoryBlock):
                before = memory.get(index)
                before = torch.zeros_like(x[:1]) if before is None else before
                past = torch.cat([before, x[:-1]], dim=0)
                memory[index] = x[-1:].clone()
                x = layer(x, past)
            else:
                x = layer(x)
        return x.clamp(0.0, 1.0)


def read_state(path: Path) -> dict[str, torch.Tensor]:
    """A state dict from a .pth (torch.save; tensors only) or a .safetensors file."""
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path))
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # missing, truncated, not a zip or pickle of tensors, a safetensors error: all unreadable
        raise ConfigError(f"tiny_decoder_path={str(path)!r}: cannot read it as a state dict ({exc})") from exc
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConfigError(f"tiny_decoder_path={str(path)!r} does not hold a state dict of tensors")
    return state


def load_tiny_decoder(path: str | Path, device: torch.device) -> TinyDecoder:
    """The decoder of a TAEHV-layout file for Wan 2.1 latents, in float32 on `device`; ConfigError names the
    file and the first key it lacks or whose shape differs."""
    path = Path(path)
    state = {k: v for k, v in read_state(path).items() if k.startswith("decoder.")}
    decoder = TinyDecoder()
    wanted = decoder.state_dict()
    for name, tensor in wanted.items():
        if name not in state:
            raise ConfigError(f"tiny_decoder_path={str(path)!r} lacks {name!r}: not a TAEHV file for Wan 2.1 "
                              f"(taew2_1); its decoder keys: {sorted(state)[:6]}...")
        got = state[name]
        layer = decoder.decoder[int(name.split(".")[1])]
        if isinstance(layer, TimeGrow) and got.shape[0] > tensor.shape[0] and got.shape[1:] == tensor.shape[1:]:
            # Trained to grow time here too: the published loader keeps the last new frame's channels.
            state[name] = got = got[-tensor.shape[0]:]
        if got.shape != tensor.shape:
            detail = (f"; it decodes {got.shape[1]} latent channels, Wan 2.1 has {LATENT_CHANNELS}"
                      if name == "decoder.1.weight" else "")
            raise ConfigError(f"tiny_decoder_path={str(path)!r}: {name} has shape {list(got.shape)}, the Wan 2.1 "
                              f"tiny decoder's is {list(tensor.shape)}{detail}")
    if extra := sorted(set(state) - set(wanted)):
        raise ConfigError(f"tiny_decoder_path={str(path)!r} has decoder keys this layout lacks: {extra[:6]}")
    decoder.load_state_dict({name: state[name].float() for name in wanted})
    decoder = decoder.to(device).eval()
    if device.type == "cpu":
        decoder = decoder.to(memory_format=CHANNELS_LAST)  # oneDNN's own layout: no reorder per conv
    return decoder


@dataclass
class TinyDecodeState:
    """A session's decoder memory: blocks decoded one after another equal one whole-clip decode."""

    memory: dict[int, torch.Tensor] = field(default_factory=dict)
    decoded_latent_frames: int = 0


class StreamingTinyDecoder:
    """The tiny decoder behind the engine's decode interface (StreamingVae's): the owner decodes whole frames."""

    def __init__(self, decoder: TinyDecoder, device: torch.device) -> None:
        self.decoder = decoder
        self.device = device
        self._decode_stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # overlaps the DiT

    def new_decode_state(self) -> TinyDecodeState:
        return TinyDecodeState()

    def splits(self, latent_rows: int) -> bool:
        """Never: the owner decodes alone (bench/README section 16: a split would not pay)."""
        return False

    @torch.no_grad()
    def decode_block(self, latents: torch.Tensor, state: TinyDecodeState, owner: int = 0) -> np.ndarray:
        """Latents [1, 16, F, h, w] of the session's next block -> uint8 frames [n, 8h, 8w, 3]."""
        side = torch.cuda.stream(self._decode_stream) if self._decode_stream else contextlib.nullcontext()
        with side:
            x = latents[0].to(self.device, torch.float32).transpose(0, 1)  # [F, 16, h, w]: frames are the batch
            if self.device.type == "cpu":
                x = x.contiguous(memory_format=CHANNELS_LAST)
            video = self.decoder(x, state.memory)
            if state.decoded_latent_frames == 0:
                video = video[WARMUP_FRAMES:]
            state.decoded_latent_frames += latents.shape[2]
            frames = (video * 255.0).round().to(torch.uint8).cpu()  # .cpu() waits for the stream
        return frames.permute(0, 2, 3, 1).contiguous().numpy()
