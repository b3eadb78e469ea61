"""Start-up validation: everything checkable from configs alone, before any weight is read."""
from __future__ import annotations

from dataclasses import dataclass

from ..api.errors import ConfigError
from ..model.config import CheckpointConfigs, read_checkpoint_configs
from ..model.dtypes import TORCH_DTYPES
from .config import ATTENTION_BACKENDS, KNOWN_UNSUPPORTED_SP_MODES, SUPPORTED_SP_MODES, EngineConfig
from .geometry import VideoGeometry


@dataclass(frozen=True)
class EngineSpec:
    """Engine settings checked against the checkpoint's configs: what an engine is built from."""

    config: EngineConfig
    checkpoint: CheckpointConfigs


def checked_spec(config: EngineConfig, world_size: int) -> EngineSpec:
    """Read the checkpoint's JSON configs and validate the settings against them; no weight is read."""
    spec = EngineSpec(config, read_checkpoint_configs(config.checkpoint))
    validate_engine(config, spec.checkpoint, world_size)
    return spec


def validate_engine(config: EngineConfig, ckpt: CheckpointConfigs, world_size: int) -> None:
    """Everything that can be checked before weights load; each error names the offending values."""
    if config.sp_mode in KNOWN_UNSUPPORTED_SP_MODES:
        raise ConfigError(
            f"sequence-parallel mode {config.sp_mode!r} is not supported; supported: {list(SUPPORTED_SP_MODES)}"
        )
    if config.sp_mode not in SUPPORTED_SP_MODES:
        raise ConfigError(f"unknown sequence-parallel mode {config.sp_mode!r}; supported: {list(SUPPORTED_SP_MODES)}")
    if config.sp_degree < 1 or config.tp_degree < 1:
        raise ConfigError(f"sp_degree={config.sp_degree} and tp_degree={config.tp_degree} must be >= 1")
    heads = ckpt.transformer.num_attention_heads
    if heads % (config.tp_degree * config.sp_degree) != 0:
        raise ConfigError(
            f"num_attention_heads={heads} is not divisible by tp_degree x sp_degree = "
            f"{config.tp_degree} x {config.sp_degree} = {config.tp_degree * config.sp_degree}"
        )
    if config.tp_degree != 1:
        raise ConfigError(f"tp_degree={config.tp_degree}: tensor parallelism is not supported, use tp_degree=1")
    if config.sp_degree > world_size:
        raise ConfigError(f"sp_degree={config.sp_degree} is larger than the process group's world size {world_size}")
    if config.dtype not in TORCH_DTYPES:
        raise ConfigError(f"dtype={config.dtype!r}; supported: {list(TORCH_DTYPES)}")
    if config.attention_backend not in ATTENTION_BACKENDS:
        raise ConfigError(f"attention_backend={config.attention_backend!r}; supported: {list(ATTENTION_BACKENDS)}")
    if ckpt.transformer.qk_norm != "rms_norm_across_heads":
        raise ConfigError(f"qk_norm={ckpt.transformer.qk_norm!r}; only 'rms_norm_across_heads' is supported")
    if config.block_frames < 1 or config.denoise_steps < 1:
        raise ConfigError(f"block_frames={config.block_frames} and denoise_steps={config.denoise_steps} must be >= 1")
    if not 0 <= config.sink_frames <= config.window_frames - 2 * config.block_frames:
        raise ConfigError(
            f"window_frames={config.window_frames} must hold sink_frames={config.sink_frames} plus two blocks of "
            f"block_frames={config.block_frames} (the cached history and the current block)"
        )
    if config.sink_frames % config.block_frames != 0:
        raise ConfigError(f"sink_frames={config.sink_frames} must be a multiple of block_frames={config.block_frames}")
    expected_camera = 6 * ckpt.vae.temporal_factor
    if ckpt.transformer.camera_dim != expected_camera:
        raise ConfigError(
            f"transformer camera_dim={ckpt.transformer.camera_dim} does not match 6 Pluecker channels x VAE temporal "
            f"factor {ckpt.vae.temporal_factor} = {expected_camera}"
        )
    expected_in = 2 * ckpt.vae.z_dim + ckpt.vae.temporal_factor
    if ckpt.transformer.in_channels != expected_in or ckpt.transformer.out_channels != ckpt.vae.z_dim:
        raise ConfigError(
            f"transformer in/out channels {ckpt.transformer.in_channels}/{ckpt.transformer.out_channels} do not fit "
            f"VAE z_dim={ckpt.vae.z_dim}: expected {expected_in} (noise + image latents + mask) / {ckpt.vae.z_dim}"
        )
    VideoGeometry.build(config, ckpt, config.default_height, config.default_width, None)
