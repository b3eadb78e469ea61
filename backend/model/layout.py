"""What a checkpoint layout is, as data (`Layout`), and a checkpoint directory found to hold one (`CheckpointLayout`).

Each layout is one module beside this one (`layout_official`, `layout_diffusers`) that defines a `Layout`;
`layouts.LAYOUTS` lists them and `layouts.resolve_layout` tells which one a directory holds.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # hints only: a layout is read without torch (the launcher's start-up check)
    import torch

# The parts every layout has (CheckpointLayout's paths); a layout may name more files that mark it.
PARTS = ("transformer", "vae", "text_encoder", "tokenizer")


@dataclass(frozen=True)
class Setting:
    value: float | int
    source: str  # where the value comes from: a parameter, a checkpoint file, a source default


@dataclass(frozen=True, eq=False)
class Layout:
    """One download's layout: its files, its source's settings, and how its configs and models are read."""

    name: str
    parts: Mapping[str, str]  # part -> path relative to the checkpoint directory: each of PARTS, any marker file too
    # block_frames, timestep_shift, window_frames and sink_frames where the checkpoint's files name none
    source_defaults: Mapping[str, Setting]
    vae_config: Callable[[CheckpointLayout], Mapping[str, Any]]  # AutoencoderKLWan's config keys (VaeConfig's input)
    file_settings: Callable[[CheckpointLayout], dict[str, Setting]]  # the settings the checkpoint's files name
    load_vae: Callable[[CheckpointLayout, torch.dtype, torch.device], torch.nn.Module]  # AutoencoderKLWan
    # UMT5EncoderModel and its tokenizer
    load_text_encoder: Callable[[CheckpointLayout, torch.dtype, torch.device], tuple[torch.nn.Module, object]]


@dataclass(frozen=True)
class CheckpointLayout:
    """A checkpoint directory in one layout: where its parts are; its layout's hooks, asked of it."""

    kind: Layout
    root: Path
    transformer: Path  # config.json + safetensors (single or sharded with an index)
    vae: Path  # e.g. Wan2.1_VAE.pth, or the AutoencoderKLWan directory
    text_encoder: Path  # e.g. models_t5_umt5-xxl-enc-bf16.pth, or the UMT5EncoderModel directory
    tokenizer: Path

    def vae_config(self) -> Mapping[str, Any]:
        return self.kind.vae_config(self)

    def file_settings(self) -> dict[str, Setting]:
        return self.kind.file_settings(self)

    def load_vae(self, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
        return self.kind.load_vae(self, dtype, device)

    def load_text_encoder(self, dtype: torch.dtype, device: torch.device) -> tuple[torch.nn.Module, object]:
        return self.kind.load_text_encoder(self, dtype, device)
