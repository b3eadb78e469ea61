"""Start-up validation: everything checkable from configs alone, before any weight is read."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from ..api.contract import SETTINGS_MISMATCH
from ..api.errors import ConfigError, InputError
from ..api.provenance import parse_settings, setting_differences, settings_of
from ..api.request import SessionRequest, check_frame_counts
from ..model.config import CheckpointConfigs, read_checkpoint_configs
from ..model.dtypes import TORCH_DTYPES
from ..model.layout import Setting
from ..model.layouts import resolve_layout
from ..model import tiny_vae
from .settings import (ATTENTION_BACKENDS, CHECKPOINT_SETTINGS, CPU_VAE_KERNELS, DECODERS, KNOWN_UNSUPPORTED_SP_MODES,
                     SUPPORTED_SP_MODES, EngineSettings)
from .geometry import VideoGeometry

GLOBAL_WINDOW = -1  # window_frames: every frame of a session stays in its KV cache (the reference's -1)
PARAMETER = "parameter"


@dataclass(frozen=True)
class EngineSpec:
    """Engine settings checked against the checkpoint's configs: what an engine is built from. `config` holds
    the resolved block_frames, timestep_shift, window_frames and sink_frames; `settings` says where each came from."""

    config: EngineSettings
    checkpoint: CheckpointConfigs
    settings: dict[str, Setting]

    @property
    def window_frames(self) -> int:
        return self.config.window_frames

    @property
    def sink_frames(self) -> int:
        return self.config.sink_frames

    @property
    def shift(self) -> float:
        return self.config.timestep_shift


def checked_spec(config: EngineSettings, world_size: int) -> EngineSpec:
    """Read the checkpoint's JSON configs, resolve what the settings leave to the checkpoint, and validate;
    no weight is read."""
    return spec_from_configs(config, read_checkpoint_configs(resolve_layout(config.checkpoint)), world_size)


def spec_from_configs(config: EngineSettings, ckpt: CheckpointConfigs, world_size: int) -> EngineSpec:
    """Resolve the settings against configs already in memory (a random-weights engine has no files), and validate."""
    settings = resolve_settings(config, ckpt)
    resolved = dataclasses.replace(config, **{name: s.value for name, s in settings.items()})
    spec = EngineSpec(resolved, ckpt, settings)
    validate_engine(spec, world_size)
    return spec


def resolve_settings(config: EngineSettings, ckpt: CheckpointConfigs) -> dict[str, Setting]:
    """The one place the settings of CHECKPOINT_SETTINGS are decided: an explicit parameter (any value but the
    table's) wins, else the checkpoint's (its file, else its layout's source default)."""
    return {name: ckpt.settings[name] if getattr(config, name) == unset else Setting(getattr(config, name), PARAMETER)
            for name, unset in CHECKPOINT_SETTINGS.items()}


def describe_settings(spec: EngineSpec) -> list[str]:
    """One line per resolved setting: its value and where it came from (logged at load)."""
    lines = [f"{name} = {s.value} ({s.source})" for name, s in spec.settings.items()]
    if spec.window_frames == GLOBAL_WINDOW:
        lines.append("window_frames = -1: global attention, each session's cache holds all its frames (no eviction, "
                     "so sink_frames has no effect); a steered session needs max_blocks")
    return lines


def validate_engine(spec: EngineSpec, world_size: int) -> None:
    """Everything that can be checked before weights load; each error names the offending values."""
    config, ckpt = spec.config, spec.checkpoint
    t, vae = ckpt.transformer, ckpt.vae
    if config.sp_mode in KNOWN_UNSUPPORTED_SP_MODES:
        raise ConfigError(
            f"sequence-parallel mode {config.sp_mode!r} is not supported; supported: {list(SUPPORTED_SP_MODES)}"
        )
    if config.sp_mode not in SUPPORTED_SP_MODES:
        raise ConfigError(f"unknown sequence-parallel mode {config.sp_mode!r}; supported: {list(SUPPORTED_SP_MODES)}")
    if config.sp_degree < 1 or config.tp_degree < 1:
        raise ConfigError(f"sp_degree={config.sp_degree} and tp_degree={config.tp_degree} must be >= 1")
    if t.num_heads % (config.tp_degree * config.sp_degree) != 0:
        raise ConfigError(
            f"num_heads={t.num_heads} is not divisible by tp_degree x sp_degree = "
            f"{config.tp_degree} x {config.sp_degree} = {config.tp_degree * config.sp_degree}"
        )
    if t.ffn_dim % config.tp_degree != 0:
        raise ConfigError(f"ffn_dim={t.ffn_dim} is not divisible by tp_degree={config.tp_degree} (FFN column split)")
    ranks = config.tp_degree * config.sp_degree
    if config.tp_degree == 1 and config.sp_degree > world_size:
        raise ConfigError(f"sp_degree={config.sp_degree} is larger than the process group's world size {world_size}")
    if config.tp_degree > 1 and ranks != world_size:
        raise ConfigError(
            f"tp_degree x sp_degree = {config.tp_degree} x {config.sp_degree} = {ranks} must equal the process "
            f"group's world size {world_size} (one rank per instance)"
        )
    if config.dtype not in TORCH_DTYPES:
        raise ConfigError(f"dtype={config.dtype!r}; supported: {list(TORCH_DTYPES)}")
    if config.attention_backend not in ATTENTION_BACKENDS:
        raise ConfigError(f"attention_backend={config.attention_backend!r}; supported: {list(ATTENTION_BACKENDS)}")
    if config.cpu_vae_kernels not in CPU_VAE_KERNELS:
        raise ConfigError(f"cpu_vae_kernels={config.cpu_vae_kernels!r}; supported: {list(CPU_VAE_KERNELS)}")
    if config.block_frames < 1 or config.denoise_steps < 1:
        raise ConfigError(f"block_frames={config.block_frames} and denoise_steps={config.denoise_steps} must be >= 1")
    if 1000 % config.denoise_steps != 0:
        raise ConfigError(f"denoise_steps={config.denoise_steps} must divide the 1000 training timesteps")
    if spec.shift <= 0:
        raise ConfigError(f"timestep_shift={spec.shift} must be positive")
    window, sink = spec.window_frames, spec.sink_frames
    # The reference's eviction keeps the sink and rolls the rest so that the new block fits the window:
    # it needs sink + block <= window (a larger sink would be overwritten by the block); any such sink and
    # window run, multiples of the block or not (e.g. window 6 / sink 3 with 3-frame blocks).
    if window != GLOBAL_WINDOW and not 0 <= sink <= window - config.block_frames:
        raise ConfigError(
            f"window_frames={window} ({spec.settings['window_frames'].source}) must hold sink_frames={sink} "
            f"({spec.settings['sink_frames'].source}) plus one block of block_frames={config.block_frames} "
            f"(sink_frames from 0 to window_frames - block_frames = {window - config.block_frames}), or be "
            f"{GLOBAL_WINDOW} (global attention)"
        )
    camera_channels = 6 * vae.spatial_factor**2  # Pluecker [origin, direction] x the VAE's pixels per latent pixel
    if t.camera_channels != camera_channels:
        raise ConfigError(
            f"the transformer's camera input takes {t.camera_channels} channels per latent pixel; the VAE's "
            f"{vae.spatial_factor}x{vae.spatial_factor} pixels give 6 x {vae.spatial_factor ** 2} = {camera_channels}"
        )
    expected_in = 2 * vae.z_dim + vae.temporal_factor
    if t.in_dim != expected_in or t.out_dim != vae.z_dim:
        raise ConfigError(
            f"transformer in/out channels {t.in_dim}/{t.out_dim} do not fit VAE z_dim={vae.z_dim}: expected "
            f"{expected_in} (noise + mask + condition latents) / {vae.z_dim}"
        )
    validate_decoder(config, ckpt)
    VideoGeometry.build(config, ckpt, config.default_height, config.default_width, None)


def validate_decoder(config: EngineSettings, ckpt: CheckpointConfigs) -> None:
    """decoder=tiny: a weights file, and a VAE whose latents the tiny decoder reads (Wan 2.1's)."""
    if config.decoder not in DECODERS:
        raise ConfigError(f"decoder={config.decoder!r}; supported: {list(DECODERS)}")
    if config.decoder != "tiny":
        return
    if not config.tiny_decoder_path:
        raise ConfigError("decoder=tiny needs tiny_decoder_path: the TAEHV weights for Wan 2.1 (taew2_1.pth)")
    if not Path(config.tiny_decoder_path).is_file():
        raise ConfigError(f"tiny_decoder_path={config.tiny_decoder_path!r} is not a file")
    vae = ckpt.vae
    wanted = (tiny_vae.LATENT_CHANNELS, tiny_vae.SPATIAL_FACTOR, tiny_vae.TIME_FACTOR)
    if (vae.z_dim, vae.spatial_factor, vae.temporal_factor) != wanted:
        raise ConfigError(
            f"decoder=tiny decodes Wan 2.1 latents (z_dim {wanted[0]}, {wanted[1]}x space, {wanted[2]}x time); this "
            f"checkpoint's VAE has z_dim {vae.z_dim}, {vae.spatial_factor}x space, {vae.temporal_factor}x time")


def request_geometry(spec: EngineSpec, request: SessionRequest) -> VideoGeometry:
    """How a request whose inputs are checked (api/request.check_request) fits an engine of this spec: its
    settings (expect_settings), its size and clip length, its frame counts and its cache bound; raises InputError
    naming the input. No model work: the serving layer's admission step calls it once, on the owning rank, and
    every rank opens the session with its result.
    """
    # First: a replay made on other settings would otherwise fail on what they imply (its frame counts).
    if request.expect_settings and (differ := setting_differences(
            parse_settings(request.expect_settings), parse_settings(settings_of(spec.config), "settings_used"))):
        raise InputError(f"this server's settings differ from request parameter 'expect_settings' (the "
                         f"recording's): {'; '.join(differ)}", SETTINGS_MISMATCH)
    geometry = VideoGeometry.build(spec.config, spec.checkpoint, request.height, request.width, request.num_frames,
                                   error=InputError)
    check_frame_counts(request, geometry.block_frames)
    if spec.window_frames == GLOBAL_WINDOW and request.steered and request.max_blocks == 0:
        raise InputError("window_frames=-1 (global attention) keeps every frame of a session: a steered session "
                         "needs request parameter 'max_blocks' > 0 to bound its cache")
    return geometry


def session_window_frames(spec: EngineSpec, request: SessionRequest, geometry: VideoGeometry) -> int:
    """The latent frames a session's cache holds: the window, or a clip's (or a bounded steered session's) frames
    when they are fewer or attention is global."""
    frames = request.max_blocks * geometry.block_frames if request.steered else geometry.latent_frames
    if spec.window_frames == GLOBAL_WINDOW:
        return frames
    return spec.window_frames if request.steered else min(spec.window_frames, frames)
