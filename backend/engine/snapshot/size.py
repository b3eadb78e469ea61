"""A snapshot's bytes before it is written, from the model's geometry and the session's length alone (the store
refuses a save that would pass its quota before anything is written): the self-attention K/V of the committed
tokens, the kept commit records, the decoder's and the condition encoder's states (model/feature_caches), the
start inputs, and an allowance for the files' headers and the manifest."""
from __future__ import annotations

from dataclasses import dataclass

from ...model.memory import commit_record_bytes

GENERATOR_STATE_BYTES = 5056  # torch.Generator("cpu").get_state(): the mt19937 state
# The camera track's first inverse, last latent and last video pose (float32 4 x 4), its last motion (float64).
CAMERA_BYTES = 3 * 64 + 128
# safetensors headers (a JSON line per tensor: name, dtype, shape, offsets) and the manifest's line per tensor:
# about 150 bytes a tensor; the manifest's and shared file's own text (a prompt of MAX_PROMPT_BYTES and the
# request's fields at most) within the fixed part.
HEADER_BYTES_PER_TENSOR = 256
HEADER_BYTES_FIXED = 64 * 1024


@dataclass(frozen=True)
class SnapshotSize:
    """One snapshot's bytes by part (the whole group's); `per_rank` splits them as the ranks write them."""

    kv: int  # every rank's K/V shards together
    commits: int  # the kept commit records (in the owner's shared file)
    shared: int  # the start inputs, noise generator and camera (the owner's shared file, besides the commits)
    condition: int  # the condition encoder's state (ENCODER_RANK's file)
    decode: int  # the decoder's state (every rank its band under a split decode, else the owner's whole)
    tensors: int  # how many tensors the files hold, all ranks together

    @property
    def total(self) -> int:
        """An upper bound of the files' and the manifest's bytes."""
        return (self.kv + self.commits + self.shared + self.condition + self.decode
                + HEADER_BYTES_FIXED + HEADER_BYTES_PER_TENSOR * self.tensors)


def kv_tokens(blocks: int, block_tokens: int, capacity: int) -> int:
    """Committed tokens after `blocks` blocks through a window of `capacity` tokens."""
    return min(blocks * block_tokens, capacity)


def kept_records(blocks: int, block_tokens: int, capacity: int, sink_tokens: int) -> int:
    """Commit records kept after `blocks` blocks: those with a token the cache still holds (Session.keep_commit)."""
    evicted_end = sink_tokens + max(0, blocks * block_tokens - capacity)  # evicted: [sink, evicted_end)

    def evicted_of(first: int) -> int:
        return max(0, min(first + block_tokens, evicted_end) - max(first, sink_tokens))

    return sum(evicted_of(i * block_tokens) < block_tokens for i in range(blocks))


def kv_bytes(num_layers: int, num_heads: int, head_dim: int, tokens: int, itemsize: int) -> int:
    """The K/V of `tokens` committed tokens, every layer and head (split over the ranks by heads)."""
    return num_layers * 2 * tokens * num_heads * head_dim * itemsize


def commit_bytes(records: int, z_dim: int, block_frames: int, latent_height: int, latent_width: int) -> int:
    return records * commit_record_bytes(z_dim, block_frames, latent_height, latent_width)


def shared_bytes(height_in: int, width_in: int, pose_count: int) -> int:
    """The start inputs (the image as sent, uint8; the poses and intrinsics, float32) and the generator and camera."""
    return height_in * width_in * 3 + pose_count * 16 * 4 + 16 + GENERATOR_STATE_BYTES + CAMERA_BYTES


def condition_bytes(encoder_state: int, z_dim: int, height: int, width: int, latent_height: int,
                    latent_width: int) -> int:
    """The condition encoder's state: its feature cache (until its fixed point), the prepared image (float32
    [3, height, width]) and at most two latents (the last zero chunk's and the fixed point's, float32)."""
    return encoder_state + 3 * height * width * 4 + 2 * z_dim * latent_height * latent_width * 4
