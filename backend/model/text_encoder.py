"""Prompt -> umT5 hidden states, padded with zeros to a fixed length as Wan does."""
from __future__ import annotations

from typing import Protocol

import torch


class PromptStates(Protocol):
    """What the engine asks of a prompt encoder."""

    def encode(self, prompt: str) -> torch.Tensor:
        """[1, n <= text_len, text_dim] states of the prompt (zeros after its real tokens)."""
        ...


class PromptEncoder:
    def __init__(self, encoder: torch.nn.Module, tokenizer: object, text_len: int, device: torch.device) -> None:
        self.encoder = encoder
        self.tokenizer = tokenizer
        self.text_len = text_len
        self.device = device

    @torch.no_grad()
    def encode(self, prompt: str) -> torch.Tensor:
        """[1, text_len, text_dim]: the encoder's states for the real tokens, zeros after them."""
        batch = self.tokenizer(
            [prompt],
            padding="max_length",
            truncation=True,
            max_length=self.text_len,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        ids = batch.input_ids.to(self.device)
        mask = batch.attention_mask.to(self.device)
        states = self.encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        return states * mask[..., None].to(states.dtype)
