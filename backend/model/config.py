"""The checkpoint's JSON configs (transformer, VAE), read without touching any weight."""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..api.errors import ConfigError


@dataclass(frozen=True)
class TransformerConfig:
    """`transformer/config.json` of a diffusers-format checkpoint (Wan key names plus camera conditioning)."""

    patch_size: tuple[int, int, int] = (1, 2, 2)
    num_attention_heads: int = 40
    attention_head_dim: int = 128
    in_channels: int = 36
    out_channels: int = 16
    text_dim: int = 4096
    freq_dim: int = 256
    ffn_dim: int = 13824
    num_layers: int = 40
    cross_attn_norm: bool = True
    qk_norm: str = "rms_norm_across_heads"
    eps: float = 1e-6
    rope_max_seq_len: int = 1024
    camera_dim: int = 24  # Pluecker channels per latent frame: 6 x VAE temporal factor

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> TransformerConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in raw.items() if k in names}
        if "patch_size" in values:
            values["patch_size"] = tuple(values["patch_size"])
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["patch_size"] = list(self.patch_size)
        return out


@dataclass(frozen=True)
class VaeConfig:
    """The geometry the engine needs from `vae/config.json` (diffusers `AutoencoderKLWan`)."""

    z_dim: int
    spatial_factor: int
    temporal_factor: int

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> VaeConfig:
        downsample = raw.get("temperal_downsample", [False, True, True])
        dim_mult = raw.get("dim_mult", [1, 2, 4, 4])
        return cls(
            z_dim=int(raw.get("z_dim", 16)),
            spatial_factor=2 ** (len(dim_mult) - 1),
            temporal_factor=2 ** sum(bool(d) for d in downsample),
        )


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"{path} not found: the checkpoint must be a diffusers-format model directory")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from exc


@dataclass(frozen=True)
class CheckpointConfigs:
    transformer: TransformerConfig
    vae: VaeConfig


def read_checkpoint_configs(checkpoint: str) -> CheckpointConfigs:
    """Read only the JSON files of a checkpoint: no weights are touched."""
    root = Path(checkpoint)
    if not root.is_dir():
        raise ConfigError(f"checkpoint directory {root} does not exist")
    index = read_json(root / "model_index.json")
    missing = [c for c in ("transformer", "vae", "text_encoder", "tokenizer") if c not in index]
    if missing:
        raise ConfigError(f"{root / 'model_index.json'} lacks component(s) {missing}")
    return CheckpointConfigs(
        transformer=TransformerConfig.from_dict(read_json(root / "transformer" / "config.json")),
        vae=VaeConfig.from_dict(read_json(root / "vae" / "config.json")),
    )


