"""How one engine instance serves a checkpoint (config.pbtxt `parameters`; torch-free)."""
from __future__ import annotations

from dataclasses import dataclass

from ..api.settings import runtime_field

SUPPORTED_SP_MODES = ("ulysses",)
KNOWN_UNSUPPORTED_SP_MODES = ("ring", "all_gather", "a2a_permute", "hybrid")
ATTENTION_BACKENDS = ("auto", "flash", "sdpa")


@dataclass(frozen=True)
class EngineConfig:
    """How one engine instance serves a checkpoint. Defaults match the LingBot-World v2 fast workload."""

    checkpoint: str
    sp_degree: int = 1
    tp_degree: int = 1
    sp_mode: str = "ulysses"
    dtype: str = "bfloat16"
    attention_backend: str = "auto"
    device: str = runtime_field("cpu")  # set by the instance: "cpu" or "cuda:<id>"
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
