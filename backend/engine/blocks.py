"""What one AR block takes (a steered session's agreed camera) and gives (its latents and timings)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..api.request import Controls


@dataclass
class BlockOutput:
    session_id: str
    block_index: int
    num_blocks: int
    latents: torch.Tensor  # [1, z, block_frames, h, w] normalised latents, float32, on CPU
    dit_ms: float
    all_to_all_bytes: int  # this rank's bytes sent by all-to-all during this block's forwards
    all_reduce_bytes: int = 0  # this rank's TP all-reduce payload during them (parallel/tensor)
    all_gather_bytes: int = 0  # this rank's TP all-gather payload during them
    held: bool = False  # a steered block run on its last motion because its step came late
    camera: np.ndarray | None = None  # float32 [n, 4, 4]: the camera-to-world poses of its new video frames, as run
    prompt: str = ""  # the prompt in force
    recached: bool = False  # its cached history was recomputed under its prompt first (a prompt event's recache)


@dataclass(frozen=True)
class BlockControls:
    """A steered session's camera for one block, as the group agreed on it."""

    controls: Controls | None  # None: repeat the last block's motion (held)
    recached: bool = False  # the session's cache was recomputed under its prompt at the boundary before
