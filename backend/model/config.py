"""The model's configs (transformer, VAE), and a checkpoint's read without touching any weight.

Transformer field names are the reference's (`WanModelFast` in robbyant/lingbot-world-v2), so the random
checkpoints write what the published checkpoint carries; diffusers-style names are accepted too.
"""
from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..api.errors import ConfigError
from .layout import CheckpointLayout, Setting
from .weight_files import tensor_shape

log = logging.getLogger(__name__)

# Pluecker rays have 6 channels; the pipeline folds the VAE's 8x8 spatial stride into the channel axis.
PLUECKER_CHANNELS = 6
VAE_SPATIAL_FOLD = 8 * 8

# Keys of the reference's config.json that carry no model hyper-parameter for us.
_METADATA_KEYS = {"_class_name", "_diffusers_version", "_name_or_path", "model_type"}

# Diffusers' WanTransformer3DModel name -> reference name (same meaning, same value).
_DIFFUSERS_ALIASES = {
    "in_channels": "in_dim",
    "out_channels": "out_dim",
}


@dataclass(frozen=True)
class TransformerConfig:
    """The DiT's architecture, as the checkpoint's config.json gives it (14B values: `lingbot_14b`)."""

    dim: int  # hidden width of every token (5,120)
    ffn_dim: int  # width of each block's feed-forward layer (13,824)
    num_heads: int  # attention heads, self and cross (40): Ulysses and TP split these
    num_layers: int  # transformer blocks (40)
    in_dim: int  # latent channels in: noisy z, the 4-channel mask and the condition z (16 + 4 + 16 = 36)
    out_dim: int  # latent channels out: the velocity of z (16)
    text_dim: int = 4096  # width of the umT5 states the text embedding takes (read off its weight's shape)
    freq_dim: int = 256  # width of the sinusoidal timestep embedding
    text_len: int = 512  # umT5 tokens per prompt (padded)
    eps: float = 1e-6  # the layer norms' and RMS norms' epsilon
    qk_norm: bool = True  # RMS-normalise queries and keys before attention
    cross_attn_norm: bool = True  # a layer norm before each cross-attention
    patch_size: tuple[int, int, int] = (1, 2, 2)  # latent frames x rows x columns per token
    # The KV window as config.json names it (None: not named; -1: global attention). What is served is
    # resolved with the layout's source defaults and the parameters (engine.validation.resolve_settings).
    local_attn_size: int | None = None  # latent frames a query block attends to (sink + rolling history + itself)
    sink_size: int | None = None  # first latent frames never evicted from the self-attention cache

    def __post_init__(self) -> None:
        object.__setattr__(self, "patch_size", tuple(int(p) for p in self.patch_size))
        if len(self.patch_size) != 3:
            raise ConfigError(f"patch_size must have 3 entries, got {self.patch_size}")
        if self.dim % self.num_heads:
            raise ConfigError(f"dim {self.dim} is not divisible by num_heads {self.num_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim {self.head_dim} must be even (rotary pairs)")
        window, sink = self.local_attn_size, self.sink_size
        if window is not None and sink is not None and window != -1 and not 0 <= sink < window:
            raise ConfigError(f"sink_size {self.sink_size} must be in [0, local_attn_size={self.local_attn_size})")

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def camera_channels(self) -> int:
        """Channels of the camera map the caller passes per latent pixel (6 Pluecker x 8 x 8 pixels)."""
        return PLUECKER_CHANNELS * VAE_SPATIAL_FOLD

    @property
    def camera_dim(self) -> int:
        """Features per camera token after the 1x2x2 patchify (input of patch_embedding_wancamctrl)."""
        return self.camera_channels * math.prod(self.patch_size)

    @classmethod
    def lingbot_14b(cls) -> TransformerConfig:
        """The published 14B model (wan/configs/wan_i2v_A14B.py + run_fast.sh window 18, sink 6)."""
        return cls(
            dim=5120,
            ffn_dim=13824,
            num_heads=40,
            num_layers=40,
            in_dim=36,
            out_dim=16,
            text_dim=4096,
            freq_dim=256,
            text_len=512,
            eps=1e-6,
            qk_norm=True,
            cross_attn_norm=True,
            patch_size=(1, 2, 2),
            local_attn_size=18,
            sink_size=6,
        )

    def to_dict(self) -> dict[str, Any]:
        """The reference's names (ConfigMixin style); patch_size as a list for JSON."""
        out = asdict(self)
        out["patch_size"] = list(self.patch_size)
        out["model_type"] = "i2v"
        return out

    @classmethod
    def from_dict(
        cls,
        raw: Mapping[str, Any],
        log: logging.Logger | None = None,
        *,
        text_dim: int | None = None,
        local_attn_size: int | None = None,
        sink_size: int | None = None,
    ) -> TransformerConfig:
        """Build from a config.json mapping in the reference's or diffusers' naming.

        text_dim: the width of `text_embedding.0.weight` (its dim 1). The reference lists text_dim in
            `ignore_for_config`, so its config.json lacks it; this argument wins over the mapping.
        local_attn_size / sink_size: the reference passes these at load time (run_fast.sh: 18 / 6),
            overriding whatever the checkpoint's config.json says; same here when given.
        Missing required keys raise ValueError; unknown keys are logged (warning) and ignored.
        """
        log = log or logging.getLogger(__name__)
        values: dict[str, Any] = {}
        unknown: list[str] = []
        fields = set(cls.__dataclass_fields__)
        for key, value in raw.items():
            if key in _METADATA_KEYS:
                continue
            name = _DIFFUSERS_ALIASES.get(key, key)
            if name in fields:
                values[name] = value
            elif key not in ("num_attention_heads", "attention_head_dim"):
                unknown.append(key)

        # diffusers: num_attention_heads x attention_head_dim instead of dim / num_heads.
        if "num_attention_heads" in raw or "attention_head_dim" in raw:
            for key in ("num_attention_heads", "attention_head_dim"):
                if key not in raw:
                    raise ConfigError(f"config has diffusers-style head keys but lacks {key!r}")
            heads, head_dim = int(raw["num_attention_heads"]), int(raw["attention_head_dim"])
            if "num_heads" in values and int(values["num_heads"]) != heads:
                raise ConfigError(f"num_heads {values['num_heads']} != num_attention_heads {heads}")
            if "dim" in values and int(values["dim"]) != heads * head_dim:
                raise ConfigError(f"dim {values['dim']} != num_attention_heads x attention_head_dim {heads * head_dim}")
            values["num_heads"], values["dim"] = heads, heads * head_dim

        if "qk_norm" in values:
            values["qk_norm"] = _parse_qk_norm(values["qk_norm"])
        if "cross_attn_norm" in values:
            values["cross_attn_norm"] = bool(values["cross_attn_norm"])
        if "patch_size" in values:
            values["patch_size"] = tuple(int(p) for p in values["patch_size"])
        if text_dim is not None:
            values["text_dim"] = int(text_dim)
        if local_attn_size is not None:
            values["local_attn_size"] = int(local_attn_size)
        if sink_size is not None:
            values["sink_size"] = int(sink_size)

        for key in ("dim", "ffn_dim", "num_heads", "num_layers", "in_dim", "out_dim"):
            if key not in values:
                raise ConfigError(f"transformer config is missing required key {key!r}")
        for key in ("dim", "ffn_dim", "num_heads", "num_layers", "in_dim", "out_dim", "text_dim", "freq_dim",
                    "text_len", "local_attn_size", "sink_size"):
            if values.get(key) is not None:
                values[key] = int(values[key])
        if "eps" in values:
            values["eps"] = float(values["eps"])
        if unknown:
            log.warning("ignoring unknown transformer config keys: %s", ", ".join(sorted(unknown)))
        return cls(**values)


def _parse_qk_norm(value: Any) -> bool:
    """Reference: bool. Diffusers: 'rms_norm_across_heads' (what this model does) or None."""
    if isinstance(value, bool):
        return value
    if value is None:
        return False
    if value == "rms_norm_across_heads":
        return True
    raise ConfigError(f"qk_norm={value!r} is not supported (RMSNorm over the whole dim only)")


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
        raise ConfigError(f"{path} not found")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from exc


@dataclass(frozen=True)
class CheckpointConfigs:
    transformer: TransformerConfig
    vae: VaeConfig
    layout: CheckpointLayout | None  # None for a model built in memory (the random-weights benchmark)
    # block_frames, timestep_shift, window_frames, sink_frames as the checkpoint's files or its layout's source say
    settings: Mapping[str, Setting]


def read_checkpoint_configs(layout: CheckpointLayout) -> CheckpointConfigs:
    """Read only the configs of a checkpoint, whichever its layout: the JSON files (and a safetensors header when
    config.json omits text_dim), and what its layout reads for the VAE's geometry and the checkpoint's settings."""
    config_path = layout.transformer / "config.json"
    raw = read_json(config_path)
    text_dim = None
    if "text_dim" not in raw:  # the reference class does not save it: read the text embedding's width
        text_dim = tensor_shape(layout.transformer, "text_embedding.0.weight")[1]
    try:
        transformer = TransformerConfig.from_dict(raw, log, text_dim=text_dim)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{config_path}: {exc}") from exc
    vae = VaeConfig.from_dict(layout.vae_config())
    return CheckpointConfigs(transformer, vae, layout, {**layout.kind.source_defaults, **layout.file_settings()})
