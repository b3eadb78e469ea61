"""One session's state on one rank: its request, geometry, noise generator, camera track and caches."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..api.request import SessionRequest
from ..model.condition import ConditionState
from ..model.kv_cache import SelfAttentionCache, TextCache
from ..model.vae import DecodeState
from .camera_track import CameraTrack
from .geometry import VideoGeometry


@dataclass
class Session:
    id: str
    request: SessionRequest
    geometry: VideoGeometry
    generator: torch.Generator
    camera: CameraTrack
    planned: list[np.ndarray]  # a whole trajectory's video poses per block; empty for a steered session
    condition: ConditionState | None  # the first-frame condition's encoder (on ENCODER_RANK only)
    prompt: str  # the prompt in force (the request's, until a world event changes it)
    text: TextCache  # its cross-attention K/V (this rank's head shard)
    cache: SelfAttentionCache
    decode_state: DecodeState | None
    split_decode: bool  # every rank decodes a band of its blocks' rows (else its owner decodes them alone)
    owner: int = 0  # the rank that answers the session's request: its decoded frames come back there
    block_index: int = 0

    @property
    def steered(self) -> bool:
        return self.request.steered

    @property
    def num_blocks(self) -> int:
        """Blocks of the session: its clip's, a steered session's max_blocks, or 0 (open-ended)."""
        return self.request.max_blocks if self.steered else self.geometry.num_blocks

    @property
    def done(self) -> bool:
        """Its set length has run (a direct caller's loop ends here; the serving layer's scheduler decides when
        a served session ends)."""
        return 0 < self.num_blocks <= self.block_index

    def cache_bytes(self) -> int:
        return self.cache.nbytes() + self.text.nbytes()
