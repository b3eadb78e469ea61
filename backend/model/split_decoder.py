"""The Wan VAE decoder run on one band of image rows per rank, equal to the whole-frame decode.

Every layer of the Wan decoder is local in space except two kinds: 3x3 convolutions (a causal 3x3x3 or an
upsampler's 2D 3x3, each zero-padded by one row) and the middle block's spatial self-attention. So each
rank decodes its band of latent rows with the same causal feature cache as a whole-frame decode (its cache
holds its band only), a 3x3 convolution first takes one row from each neighbour (`RowBands.halo`) in place
of the zero padding, and the attention block runs on all rows (`RowBands.all_rows`, at the latent
resolution, where it is cheap) and keeps its band. Nearest 2x upsampling maps a band onto a band, and
RMS norms, SiLU and 1x1 convolutions are per pixel. Only the convolutions' blocking differs from the
whole-frame decode, so frames agree to float rounding (tests/test_split_decode.py measures it).

`SplitDecoder.bands(...)` switches the decoder's modules to the band path for one decode; outside it they
run as diffusers wrote them.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ..parallel.rows import RowBands

if TYPE_CHECKING:
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanAttentionBlock, WanCausalConv3d


class SplitDecoder:
    def __init__(self, decoder: torch.nn.Module) -> None:
        # diffusers at a VAE's load, not at the engine's import (tests/test_rooms)
        from diffusers.models.autoencoders.autoencoder_kl_wan import WanAttentionBlock, WanCausalConv3d, WanResample

        self.decoder = decoder
        self._bands: RowBands | None = None
        for module in decoder.modules():
            if isinstance(module, WanCausalConv3d) and module._padding[2] > 0:
                module.forward = self._causal_conv(module, WanCausalConv3d.forward)
            elif isinstance(module, WanResample):
                for conv in module.resample.modules():
                    if isinstance(conv, torch.nn.Conv2d) and conv.padding[0] > 0:
                        conv.forward = self._conv2d(conv)
            elif isinstance(module, WanAttentionBlock):
                module.forward = self._attention(module, WanAttentionBlock.forward)

    @contextlib.contextmanager
    def bands(self, bands: RowBands) -> Iterator[None]:
        """Within it, the decoder takes and returns this rank's band of rows."""
        self._bands = bands
        try:
            yield
        finally:
            self._bands = None

    def _causal_conv(self, conv: WanCausalConv3d, whole_frame: Callable[..., torch.Tensor]):
        def forward(x: torch.Tensor, cache_x: torch.Tensor | None = None) -> torch.Tensor:
            bands = self._bands
            if bands is None:
                return whole_frame(conv, x, cache_x)
            padding = list(conv._padding)  # (w, w, h, h, causal t, 0)
            if cache_x is not None and padding[4] > 0:
                x = torch.cat([cache_x.to(x.device), x], dim=2)
                padding[4] -= cache_x.shape[2]
            x = bands.halo(x, padding[2])
            padding[2] = padding[3] = 0
            return torch.nn.Conv3d.forward(conv, F.pad(x, padding))

        return forward

    def _conv2d(self, conv: torch.nn.Conv2d):
        def forward(x: torch.Tensor) -> torch.Tensor:
            bands = self._bands
            if bands is None:
                return torch.nn.Conv2d.forward(conv, x)
            rows, cols = conv.padding
            x = F.pad(bands.halo(x, rows), (cols, cols, 0, 0))
            return F.conv2d(x, conv.weight, conv.bias, conv.stride, 0, conv.dilation, conv.groups)

        return forward

    def _attention(self, block: WanAttentionBlock, whole_frame: Callable[..., torch.Tensor]):
        def forward(x: torch.Tensor) -> torch.Tensor:
            bands = self._bands
            if bands is None:
                return whole_frame(block, x)
            return bands.local(whole_frame(block, bands.all_rows(x)), bands.factor(x))

        return forward
