"""One session's state on one rank: its request, geometry, noise generator, camera track and caches."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..api.request import SessionRequest
from ..model.condition import ConditionState
from ..model.kv_cache import SelfAttentionCache, TextCache
from ..model.tiny_vae import StreamingTinyDecoder, TinyDecodeState
from ..model.vae import DecodeState, StreamingVae
from .blocks import BlockOutput
from .camera_track import CameraTrack
from .geometry import VideoGeometry


@dataclass(frozen=True)
class CommitRecord:
    """What one committed block was made of: enough to run the forward that wrote its K/V again (engine.recache).

    At the 14B geometry (480x832, z 16, 3-frame blocks: latents 16 x 3 x 60 x 104) one record is 2,396,352 B:
    its latents and the condition latents 1,198,080 B each in float32, the poses 192 B
    (model/memory.commit_record_bytes). A window of 18 frames with a 6-frame sink holds the tokens of at most 6
    blocks, so a session keeps at most 6 records between blocks: 14,378,112 B (13.7 MiB) on every rank, beside
    its 23 GB self-attention window at SP1.
    """

    first_frame: int  # its first latent frame (its RoPE positions and condition mask)
    latents: torch.Tensor  # [1, z, block_frames, h, w] float32: what that forward took (the clean latents; under
    # kv_reuse the last DMD step's noisy input)
    timestep: float  # that forward's timestep: 0 for the commit forward, under kv_reuse the last step's
    poses: torch.Tensor  # [block_frames, 4, 4] float32: its model poses (CameraTrack.next_block)
    condition: torch.Tensor  # [1, z, block_frames, h, w] float32: its condition latents (broadcast, no mask)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.latents, self.poses, self.condition))


@dataclass
class Decoding:
    """One session's decode on one rank, apart from the rest of the session: the thread that decodes its blocks (the
    serving loop's decode sender) gets it whole at the session's opening and alone touches its state from then on;
    the thread that runs the session's blocks never reads it again."""

    session_id: str
    owner: int  # the rank its frames come back to
    geometry: VideoGeometry
    state: DecodeState | TinyDecodeState | None  # the VAE's feature cache or the tiny decoder's memory; None: no frames
    split: bool  # every rank decodes a band of its blocks' rows (else its owner decodes them alone)

    def frames(self, vae: StreamingVae | StreamingTinyDecoder, output: BlockOutput) -> np.ndarray | None:
        """uint8 frames [n, H, W, 3] of one block (in block order) on the owner; empty when the session decodes
        nothing; None on a rank that only helped (`split`)."""
        if self.state is None:
            return np.zeros((0, self.geometry.height, self.geometry.width, 3), dtype=np.uint8)
        return vae.decode_block(output.latents, self.state, self.owner)


@dataclass
class Session:
    id: str
    request: SessionRequest
    geometry: VideoGeometry
    generator: torch.Generator
    camera: CameraTrack
    planned: list[np.ndarray]  # a whole trajectory's video poses per block; empty for a steered session
    condition: ConditionState | None  # the first-frame condition's encoder (on ENCODER_RANK only)
    prompt: str  # the prompt in force (the request's, until a prompt event changes it)
    text: TextCache  # its cross-attention K/V (this rank's head shard)
    cache: SelfAttentionCache
    decoding: Decoding  # its decode's (the decode thread's from its opening on)
    owner: int = 0  # the rank that answers the session's request: its decoded frames come back there
    block_index: int = 0
    # The records of the committed blocks whose tokens the cache still holds, oldest first (open_session's
    # keep_commits, for engine.recache); None: kept for no block.
    commits: list[CommitRecord] | None = None

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

    def keep_commit(self, record: CommitRecord) -> None:
        """Add the block just committed; drop the records whose tokens the cache has all evicted."""
        self.commits = [r for r in (*self.commits, record) if self.evicted_of(r) < self.cache.block_tokens]

    def evicted_of(self, record: CommitRecord) -> int:
        """How many of a committed block's tokens the cache has evicted."""
        return self.cache.evicted_among(record.first_frame * self.geometry.tokens_per_frame, self.cache.block_tokens)

    def commit_bytes(self) -> int:
        """The kept records' bytes (0 without keep_commits)."""
        return sum(r.nbytes() for r in self.commits or ())
