"""Prompt states for every rank from one encoder: rank 0 runs umT5 and broadcasts; an LRU of recent prompts.

The other ranks never load the text encoder (11 GB in bf16 for umT5-XXL). Every rank opens the same sessions
in the same order, so every rank's cache holds the same prompts, and a hit skips the broadcast on all of them.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from ..model.text_encoder import PromptEncoder
from ..parallel.sequence import SequenceParallel

ENCODER_RANK = 0
CACHE_PROMPTS = 16  # at 512 x 5,120 bf16 states, 5 MB each


class SharedPrompts:
    def __init__(self, encoder: PromptEncoder | None, sp: SequenceParallel, shape: tuple[int, int, int],
                 dtype: torch.dtype, device: torch.device, capacity: int = CACHE_PROMPTS) -> None:
        """encoder: on ENCODER_RANK only; shape: [1, text_len, text_dim] of its states."""
        self.encoder = encoder
        self.sp = sp
        self.shape, self.dtype, self.device = shape, dtype, device
        self.capacity = capacity
        self.encoded = 0  # prompts this rank ran through the encoder
        self.hits = 0  # prompts served from the cache (on every rank alike)
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()

    def states(self, prompt: str) -> torch.Tensor:
        """[1, text_len, text_dim] umT5 states of `prompt` (a collective on a miss: every rank calls it)."""
        if (hit := self._cache.get(prompt)) is not None:
            self._cache.move_to_end(prompt)
            self.hits += 1
            return hit
        ok = torch.ones(1, device=self.device)
        states = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        error: Exception | None = None
        if self.encoder is not None:
            try:
                states = self.encoder.encode(prompt).to(self.dtype).contiguous()
                self.encoded += 1
            except Exception as exc:  # the others wait in the broadcast: tell them, then fail this open
                ok.zero_()
                error = exc
        if not self.sp.broadcast(ok, ENCODER_RANK).item():
            raise error or RuntimeError(f"encoding the prompt failed on rank {ENCODER_RANK}")
        self.sp.broadcast(states, ENCODER_RANK)
        self._cache[prompt] = states
        if len(self._cache) > self.capacity:
            self._cache.popitem(last=False)
        return states
