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
from ..model.dtypes import DTYPES
from ..model.layout import Setting
from ..model.layouts import resolve_layout
from ..model import tiny_vae_latents
from .settings import (ATTENTION_BACKENDS, CHECKPOINT_SETTINGS, CPU_VAE_KERNELS, DECODERS, KNOWN_UNSUPPORTED_SP_MODES,
                     SUPPORTED_SP_MODES, EngineSettings)
from .geometry import VideoGeometry

GLOBAL_WINDOW = -1  # window_frames: every frame of a session stays in its KV cache (the reference's -1)
PARAMETER = "parameter"


@dataclass(frozen=True)
class EngineSpec:
    """Engine settings checked against the checkpoint's configs: what an engine is built from. `settings` holds
    the resolved block_frames, timestep_shift, window_frames and sink_frames; `sources` says where each came from."""

    settings: EngineSettings
    checkpoint: CheckpointConfigs
    sources: dict[str, Setting]

    @property
    def window_frames(self) -> int:
        return self.settings.window_frames

    @property
    def sink_frames(self) -> int:
        return self.settings.sink_frames

    @property
    def shift(self) -> float:
        return self.settings.timestep_shift


def checked_spec(settings: EngineSettings, world_size: int) -> EngineSpec:
    """Read the checkpoint's JSON configs, resolve what the settings leave to the checkpoint, and validate;
    no weight is read."""
    return spec_from_configs(settings, read_checkpoint_configs(resolve_layout(settings.checkpoint)), world_size)


def spec_from_configs(settings: EngineSettings, ckpt: CheckpointConfigs, world_size: int) -> EngineSpec:
    """Resolve the settings against configs already in memory (a random-weights engine has no files), and validate."""
    sources = resolve_settings(settings, ckpt)
    resolved = dataclasses.replace(settings, **{name: s.value for name, s in sources.items()})
    spec = EngineSpec(resolved, ckpt, sources)
    validate_engine(spec, world_size)
    return spec


def resolve_settings(settings: EngineSettings, ckpt: CheckpointConfigs) -> dict[str, Setting]:
    """The one place the settings of CHECKPOINT_SETTINGS are decided: an explicit parameter (any value but the
    table's) wins, else the checkpoint's (its file, else its layout's source default)."""
    return {name: ckpt.settings[name] if getattr(settings, name) == unset
            else Setting(getattr(settings, name), PARAMETER) for name, unset in CHECKPOINT_SETTINGS.items()}


def describe_settings(spec: EngineSpec) -> list[str]:
    """One line per resolved setting: its value and where it came from (logged at load)."""
    lines = [f"{name} = {s.value} ({s.source})" for name, s in spec.sources.items()]
    if spec.window_frames == GLOBAL_WINDOW:
        lines.append("window_frames = -1: global attention, each session's cache holds all its frames (no eviction, "
                     "so sink_frames has no effect); a steered session needs max_blocks")
    return lines


def validate_engine(spec: EngineSpec, world_size: int) -> None:
    """Everything that can be checked before weights load; each error names the offending values."""
    settings, ckpt = spec.settings, spec.checkpoint
    t, vae = ckpt.transformer, ckpt.vae
    if settings.sp_mode in KNOWN_UNSUPPORTED_SP_MODES:
        raise ConfigError(
            f"sequence-parallel mode {settings.sp_mode!r} is not supported; supported: {list(SUPPORTED_SP_MODES)}"
        )
    if settings.sp_mode not in SUPPORTED_SP_MODES:
        raise ConfigError(f"unknown sequence-parallel mode {settings.sp_mode!r}; supported: {list(SUPPORTED_SP_MODES)}")
    if settings.sp_degree < 1 or settings.tp_degree < 1:
        raise ConfigError(f"sp_degree={settings.sp_degree} and tp_degree={settings.tp_degree} must be >= 1")
    if t.num_heads % (settings.tp_degree * settings.sp_degree) != 0:
        raise ConfigError(
            f"num_heads={t.num_heads} is not divisible by tp_degree x sp_degree = "
            f"{settings.tp_degree} x {settings.sp_degree} = {settings.tp_degree * settings.sp_degree}"
        )
    if t.ffn_dim % settings.tp_degree != 0:
        raise ConfigError(f"ffn_dim={t.ffn_dim} is not divisible by tp_degree={settings.tp_degree} (FFN column split)")
    ranks = settings.tp_degree * settings.sp_degree
    if settings.tp_degree == 1 and settings.sp_degree > world_size:
        raise ConfigError(f"sp_degree={settings.sp_degree} is larger than the process group's world size {world_size}")
    if settings.tp_degree > 1 and ranks != world_size:
        raise ConfigError(
            f"tp_degree x sp_degree = {settings.tp_degree} x {settings.sp_degree} = {ranks} must equal the process "
            f"group's world size {world_size} (one rank per instance)"
        )
    if settings.dtype not in DTYPES:
        raise ConfigError(f"dtype={settings.dtype!r}; supported: {list(DTYPES)}")
    if settings.attention_backend not in ATTENTION_BACKENDS:
        raise ConfigError(f"attention_backend={settings.attention_backend!r}; supported: {list(ATTENTION_BACKENDS)}")
    if settings.cpu_vae_kernels not in CPU_VAE_KERNELS:
        raise ConfigError(f"cpu_vae_kernels={settings.cpu_vae_kernels!r}; supported: {list(CPU_VAE_KERNELS)}")
    if settings.block_frames < 1 or settings.denoise_steps < 1:
        raise ConfigError(
            f"block_frames={settings.block_frames} and denoise_steps={settings.denoise_steps} must be >= 1")
    if 1000 % settings.denoise_steps != 0:
        raise ConfigError(f"denoise_steps={settings.denoise_steps} must divide the 1000 training timesteps")
    if spec.shift <= 0:
        raise ConfigError(f"timestep_shift={spec.shift} must be positive")
    window, sink = spec.window_frames, spec.sink_frames
    # The reference's eviction keeps the sink and rolls the rest so that the new block fits the window:
    # it needs sink + block <= window (a larger sink would be overwritten by the block); any such sink and
    # window run, multiples of the block or not (e.g. window 6 / sink 3 with 3-frame blocks).
    if window != GLOBAL_WINDOW and not 0 <= sink <= window - settings.block_frames:
        raise ConfigError(
            f"window_frames={window} ({spec.sources['window_frames'].source}) must hold sink_frames={sink} "
            f"({spec.sources['sink_frames'].source}) plus one block of block_frames={settings.block_frames} "
            f"(sink_frames from 0 to window_frames - block_frames = {window - settings.block_frames}), or be "
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
    validate_decoder(settings, ckpt)
    VideoGeometry.build(settings, ckpt, settings.default_height, settings.default_width, None)


def validate_decoder(settings: EngineSettings, ckpt: CheckpointConfigs) -> None:
    """decoder=tiny: a weights file, and a VAE whose latents the tiny decoder reads (Wan 2.1's)."""
    if settings.decoder not in DECODERS:
        raise ConfigError(f"decoder={settings.decoder!r}; supported: {list(DECODERS)}")
    if settings.decoder != "tiny":
        return
    if not settings.tiny_decoder_path:
        raise ConfigError("decoder=tiny needs tiny_decoder_path: the TAEHV weights for Wan 2.1 (taew2_1.pth)")
    if not Path(settings.tiny_decoder_path).is_file():
        raise ConfigError(f"tiny_decoder_path={settings.tiny_decoder_path!r} is not a file")
    vae = ckpt.vae
    wanted = (tiny_vae_latents.LATENT_CHANNELS, tiny_vae_latents.SPATIAL_FACTOR, tiny_vae_latents.TIME_FACTOR)
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
            parse_settings(request.expect_settings), parse_settings(settings_of(spec.settings), "settings_used"))):
        raise InputError(f"this server's settings differ from request parameter 'expect_settings' (the "
                         f"recording's): {'; '.join(differ)}", SETTINGS_MISMATCH)
    geometry = VideoGeometry.build(spec.settings, spec.checkpoint, request.height, request.width, request.num_frames,
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
