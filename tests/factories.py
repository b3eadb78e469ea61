"""Builders for the tiny model's engine settings and requests (64x64 video, 8x8 latents, 16 tokens a frame)."""
from __future__ import annotations

import dataclasses

import numpy as np

from backend.engine.settings import EngineSettings
from backend.api.request import SessionRequest

TINY_SIZE = 64
# 5 blocks of 3 latent frames through a 9-frame window with a 3-frame sink: the window fills, then slides.
TINY_FRAMES = 57


def tiny_settings(checkpoint: str, **overrides) -> EngineSettings:
    base = EngineSettings(
        checkpoint=checkpoint,
        dtype="float32",
        window_frames=9,
        sink_frames=3,
        default_height=TINY_SIZE,
        default_width=TINY_SIZE,
    )
    return dataclasses.replace(base, **overrides)


def forward_poses(num_frames: int, step: float = 0.05) -> np.ndarray:
    poses = np.tile(np.eye(4, dtype=np.float32), (num_frames, 1, 1))
    poses[:, 2, 3] = step * np.arange(num_frames, dtype=np.float32)
    return poses


def sample_image(size: int = TINY_SIZE, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)


def tiny_request(num_frames: int = TINY_FRAMES, seed: int = 42, **overrides) -> SessionRequest:
    base = SessionRequest(
        image=sample_image(),
        prompt="a castle in the forest",
        poses=forward_poses(num_frames),
        num_frames=num_frames,
        seed=seed,
        height=TINY_SIZE,
        width=TINY_SIZE,
    )
    return dataclasses.replace(base, **overrides)
