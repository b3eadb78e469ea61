"""Per-session KV cache on this rank's head shard: rolling self-attention window with sink, text K/V."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LayerKV:
    """One layer's self-attention buffers [1, capacity, local_heads, head_dim] and the committed length."""

    keys: torch.Tensor
    values: torch.Tensor
    length: int

    def attend_over(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the current block's k/v [1, L, h, d] after the history; return history + block views."""
        end = self.length + k.shape[1]
        self.keys[:, self.length : end] = k
        self.values[:, self.length : end] = v
        return self.keys[:, :end], self.values[:, :end]


class SelfAttentionCache:
    """Keys/values of committed frames for every layer, plus a slot for the block being denoised.

    Buffers are [1, capacity, local_heads, head_dim] with capacity = window tokens, so attention reads a
    contiguous prefix without copying. Size per rank: window tokens x layers x 2 x dim x bytes / sp, e.g.
    18 x 1,560 tokens x 40 x 2 x 5,120 x 2 B = 23 GB per session at SP1 and 5.7 GB at SP4 for the 14B model.
    Tokens [0, sink) are never evicted; on overflow the oldest tokens after the sink are dropped.
    """

    def __init__(
        self,
        num_layers: int,
        window_tokens: int,
        block_tokens: int,
        sink_tokens: int,
        local_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (1, window_tokens, local_heads, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.block_tokens = block_tokens
        self.sink_tokens = sink_tokens
        self.length = 0  # committed tokens
        self.evicted_tokens = 0

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[1]

    def make_room(self) -> None:
        """Before a block: evict so that history plus the new block fit the window."""
        overflow = self.length + self.block_tokens - self.capacity
        if overflow <= 0:
            return
        start, keep_from = self.sink_tokens, self.sink_tokens + overflow
        for buf in (*self.keys, *self.values):
            buf[:, start : self.length - overflow] = buf[:, keep_from : self.length].clone()
        self.length -= overflow
        self.evicted_tokens += overflow

    def layer(self, layer: int) -> LayerKV:
        """One layer's buffers and the committed length (a compiled block then sees no layer index)."""
        return LayerKV(self.keys[layer], self.values[layer], self.length)

    def commit(self) -> None:
        """Keep the block written by the last forward (the clean-KV commit) as history."""
        self.length += self.block_tokens

    def evicted_among(self, first: int, count: int) -> int:
        """How many of the `count` tokens from token `first` (counted from the first commit) were evicted: the
        evicted ones are always the tokens [sink, sink + evicted_tokens)."""
        start, end = max(first, self.sink_tokens), min(first + count, self.sink_tokens + self.evicted_tokens)
        return max(0, end - start)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


class TextCache:
    """Cross-attention K/V of the prompt for every layer, this rank's heads only: [1, text_len, h, d]."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        self.keys = keys
        self.values = values

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))
