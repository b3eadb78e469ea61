"""Engine configuration and the checkpoint's JSON configs (read without touching any weight)."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from collections.abc import Mapping

from .errors import ConfigError

SUPPORTED_SP_MODES = ("ulysses",)
KNOWN_UNSUPPORTED_SP_MODES = ("ring", "all_gather", "a2a_permute", "hybrid")
DTYPES = ("float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "flash", "sdpa")


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


@dataclass(frozen=True)
class EngineConfig:
    """How one engine instance serves a checkpoint. Defaults match the LingBot-World v2 fast workload."""

    checkpoint: str
    sp_degree: int = 1
    tp_degree: int = 1
    sp_mode: str = "ulysses"
    dtype: str = "bfloat16"
    attention_backend: str = "auto"
    device: str = "cpu"
    block_frames: int = 3  # latent frames per AR block
    denoise_steps: int = 4  # DMD steps per block (plus one clean-KV commit forward)
    timestep_shift: float = 5.0
    window_frames: int = 18  # latent frames attended by a block, itself included
    sink_frames: int = 3  # first latent frames never evicted from the KV cache
    text_len: int = 512
    default_height: int = 480  # the resolution checked at start-up; requests may ask for others
    default_width: int = 832
    decode_frames: bool = True  # decode each block to RGB with the VAE (requests may opt out)
    compile: bool = False  # torch.compile each transformer block: faster; close to eager, not bit-identical


T = TypeVar("T")


def from_parameters(cls: type[T], params: Mapping[str, str]) -> T:
    """Build a config dataclass from string key/values (Triton config.pbtxt `parameters`)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(params) - set(fields))
    if unknown:
        raise ConfigError(f"unknown {cls.__name__} parameter(s) {unknown}; known: {sorted(fields)}")
    values: dict[str, Any] = {}
    for name, raw in params.items():
        kind = fields[name].type
        try:
            values[name] = _parse(raw, kind)
        except ValueError as exc:
            raise ConfigError(f"parameter {name}={raw!r}: expected {kind}") from exc
    try:
        return cls(**values)
    except TypeError as exc:
        raise ConfigError(f"{cls.__name__}: {exc}") from exc


def _parse(raw: str, kind: str) -> Any:
    if kind == "int":
        return int(raw)
    if kind == "float":
        return float(raw)
    if kind == "bool":
        lowered = raw.strip().lower()
        if lowered not in ("true", "false", "1", "0", "yes", "no"):
            raise ValueError(raw)
        return lowered in ("true", "1", "yes")
    return raw


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


@dataclass(frozen=True)
class ServingConfig:
    """Limits and group settings of the Triton model (config.pbtxt `parameters` beside the engine's)."""

    max_frames: int = 321  # video frames per request
    max_pixels: int = 1280 * 1280  # height x width per request
    max_sessions: int = 4  # sessions generating at once (each holds a KV cache)
    max_queue: int = 16  # sessions waiting for a slot; more are rejected
    max_batch: int = 4  # sessions of one geometry run in one forward
    max_blocks_ahead: int = 2  # blocks a session may be computed ahead of what its client was sent
    rendezvous_host: str = "127.0.0.1"
    rendezvous_port: int = 29650
    init_timeout_s: float = 1800.0  # rendezvous and weight loading
    collective_timeout_s: float = 120.0  # a rank silent this long is declared failed
    idle_poll_ms: float = 5.0


def split_parameters(params: Mapping[str, str]) -> tuple[EngineConfig, ServingConfig]:
    serving_names = {f.name for f in dataclasses.fields(ServingConfig)}
    serving = {k: v for k, v in params.items() if k in serving_names}
    engine = {k: v for k, v in params.items() if k not in serving_names}
    return from_parameters(EngineConfig, engine), from_parameters(ServingConfig, serving)
