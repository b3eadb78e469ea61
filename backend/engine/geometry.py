"""Sizes of one request: pixels -> latents -> patch tokens -> AR blocks -> sequence shards."""
from __future__ import annotations

from dataclasses import dataclass

from ..api.errors import ConfigError
from ..model.config import CheckpointConfigs
from .settings import EngineSettings


@dataclass(frozen=True)
class VideoGeometry:
    height: int
    width: int
    latent_height: int
    latent_width: int
    grid_height: int  # patch tokens per latent frame, vertically
    grid_width: int
    block_frames: int
    latent_frames: int  # 0 when built for start-up checks without a clip length
    sp_degree: int

    @property
    def tokens_per_frame(self) -> int:
        return self.grid_height * self.grid_width

    @property
    def block_tokens(self) -> int:
        return self.block_frames * self.tokens_per_frame

    @property
    def block_shape(self) -> tuple[int, int]:
        """What sessions must share to run their blocks in one forward (clip lengths may differ)."""
        return (self.height, self.width)

    @property
    def num_blocks(self) -> int:
        return self.latent_frames // self.block_frames

    @staticmethod
    def build(
        settings: EngineSettings,
        ckpt: CheckpointConfigs,
        height: int,
        width: int,
        num_frames: int | None,
        error: type[ValueError] = ConfigError,
    ) -> VideoGeometry:
        """Check a resolution (and clip length) against VAE, patch, block and SP factors; raise `error` if off."""
        _, patch_h, patch_w = ckpt.transformer.patch_size
        factor_h = ckpt.vae.spatial_factor * patch_h
        factor_w = ckpt.vae.spatial_factor * patch_w
        if height <= 0 or width <= 0 or height % factor_h or width % factor_w:
            raise error(
                f"width x height = {width} x {height}: each must be a positive multiple of the VAE x patch "
                f"factor (width {factor_w}, height {factor_h})"
            )
        latent_frames = 0
        if num_frames is not None:
            t = ckpt.vae.temporal_factor
            block_video = settings.block_frames * t
            if num_frames < 1 or (num_frames - 1) % t != 0:
                raise error(f"num_frames={num_frames} must be 1 + {t} x k (causal VAE, temporal factor {t})")
            latent_frames = 1 + (num_frames - 1) // t
            if latent_frames % settings.block_frames != 0:
                first = t * settings.block_frames - t + 1
                raise error(
                    f"num_frames={num_frames} gives {latent_frames} latent frames, not a multiple of "
                    f"block_frames={settings.block_frames}; use {first} + {block_video} x k frames (e.g. 81)"
                )
        geometry = VideoGeometry(
            height=height,
            width=width,
            latent_height=height // ckpt.vae.spatial_factor,
            latent_width=width // ckpt.vae.spatial_factor,
            grid_height=height // factor_h,
            grid_width=width // factor_w,
            block_frames=settings.block_frames,
            latent_frames=latent_frames,
            sp_degree=settings.sp_degree,
        )
        if geometry.block_tokens % settings.sp_degree != 0:
            near = ", ".join(f"{w} x {h}" for w, h in sizes_near(width, height, factor_w, factor_h,
                                                                   settings.block_frames, settings.sp_degree))
            raise error(
                f"block token count {geometry.block_tokens} ({settings.block_frames} frames x "
                f"{geometry.grid_height} x {geometry.grid_width} tokens at width x height = {width} x {height}) is "
                f"not divisible by sp_degree={settings.sp_degree}; sizes near it that are: {near}"
            )
        return geometry


def sizes_near(
    width: int, height: int, factor_w: int, factor_h: int, block_frames: int, sp: int, count: int = 3
) -> list[tuple[int, int]]:
    """The `count` sizes (width, height) closest to the asked one whose block token count `sp` divides."""
    grid_w, grid_h = max(width // factor_w, 1), max(height // factor_h, 1)
    reach = 2 * sp  # every sp-th grid width divides, so this always finds some
    found = [
        (abs(gw - grid_w) * factor_w + abs(gh - grid_h) * factor_h, gw * factor_w, gh * factor_h)
        for gw in range(max(grid_w - reach, 1), grid_w + reach + 1)
        for gh in range(max(grid_h - reach, 1), grid_h + reach + 1)
        if (block_frames * gw * gh) % sp == 0
    ]
    return [(w, h) for _, w, h in sorted(found)[:count]]
