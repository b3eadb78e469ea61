"""The models an engine runs, from a checkpoint directory or built in memory."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.checkpoint import load_transformer
from ..model.dtypes import torch_dtype
from ..model.tensor_slices import TensorPart
from ..model.text_encoder import PromptEncoder, PromptStates
from ..model.tiny_vae import TinyDecoder, load_tiny_decoder
from ..model.transformer import LingBotTransformer
from .prompts import ENCODER_RANK
from .validation import EngineSpec


@dataclass
class EngineParts:
    """The models an engine runs: read from a checkpoint directory (`load_parts`) or built in memory
    (the random-weights benchmark). The transformer is in the spec's dtype, everything on the spec's device."""

    transformer: LingBotTransformer
    prompts: PromptStates | None  # only where it runs (ENCODER_RANK)
    vae: torch.nn.Module  # AutoencoderKLWan in float32, as the reference's: condition encode (on
    # ENCODER_RANK; the other ranks drop its encoder) and block decode (unless the tiny decoder decodes)
    tiny_decoder: TinyDecoder | None = None  # decoder=tiny: it decodes the blocks in the VAE's place


def load_parts(spec: EngineSpec, rank: int, part: TensorPart | None = None) -> EngineParts:
    """The transformer (this TP rank's `part`), text encoder (on ENCODER_RANK only) and VAE of the spec's
    checkpoint, as its layout reads them, and the tiny decoder when the settings choose it."""
    settings, layout = spec.settings, spec.checkpoint.layout
    device, dtype = torch.device(settings.device), torch_dtype(settings.dtype)
    transformer = load_transformer(layout.transformer, spec.checkpoint.transformer, dtype, device, part)
    prompts = None
    if rank == ENCODER_RANK:
        encoder, tokenizer = layout.load_text_encoder(dtype, device)
        prompts = PromptEncoder(encoder, tokenizer, spec.checkpoint.transformer.text_len, device)
    tiny = load_tiny_decoder(settings.tiny_decoder_path, device) if settings.decoder == "tiny" else None
    return EngineParts(transformer, prompts, layout.load_vae(torch.float32, device), tiny)
