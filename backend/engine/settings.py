"""How one engine instance serves a checkpoint (config.pbtxt `parameters`; torch-free)."""
from __future__ import annotations

from dataclasses import dataclass

from ..api.settings import runtime_field

SUPPORTED_SP_MODES = ("ulysses",)
KNOWN_UNSUPPORTED_SP_MODES = ("ring", "all_gather", "a2a_permute", "hybrid")
ATTENTION_BACKENDS = ("auto", "flash", "sdpa")
DECODERS = ("vae", "tiny")  # the Wan VAE; the TAEHV tiny decoder for Wan 2.1 (backend/model/tiny_vae)
CPU_VAE_KERNELS = ("onednn", "torch")  # the VAE's float32 CPU kernels (backend/model/cpu_vae); torch's own
# The settings a checkpoint decides unless a parameter does, each with the EngineSettings value that leaves it to the
# checkpoint (its files, else its layout's source defaults); validation.resolve_settings reads this table.
CHECKPOINT_SETTINGS = {"block_frames": 0, "timestep_shift": 0.0, "window_frames": 0, "sink_frames": -1}


@dataclass(frozen=True)
class EngineSettings:
    """How one engine instance serves a checkpoint. Defaults match the LingBot-World v2 fast workload."""

    checkpoint: str  # the diffusers-layout checkpoint directory
    sp_degree: int = 1  # Ulysses ranks: the model instances of all servers (the launcher sets it)
    tp_degree: int = 1  # tensor parallelism inside the group: tp_degree x sp_degree ranks (docs/parallelism.md)
    sp_mode: str = "ulysses"  # the sequence-parallel scheme (only "ulysses")
    dtype: str = "bfloat16"  # the DiT's weights and activations: bfloat16, float16 or float32
    attention_backend: str = "auto"  # auto, flash (flash-attn) or sdpa
    device: str = runtime_field("cpu")  # set by the instance: "cpu" or "cuda:<id>"
    # block_frames, timestep_shift, window_frames, sink_frames: left at their CHECKPOINT_SETTINGS "unset" value, they
    # come from the checkpoint (its files, else its layout's source defaults); resolved once, with provenance.
    block_frames: int = 0  # latent frames per AR block; 0: the checkpoint's
    denoise_steps: int = 4  # DMD steps per block (plus one clean-KV commit forward, unless kv_reuse)
    timestep_shift: float = 0.0  # flow-matching shift; 0: the checkpoint's
    window_frames: int = 0  # latent frames a block attends to, itself included; -1: global; 0: the checkpoint's
    sink_frames: int = -1  # first latent frames never evicted from the KV cache; -1: the checkpoint's
    default_height: int = 480  # the resolution checked at start-up; requests may ask for others
    default_width: int = 832  # with default_height
    decode_frames: bool = True  # decode each block to RGB with the VAE (requests may opt out)
    decoder: str = "vae"  # what decodes frames: vae (the Wan VAE), tiny (TAEHV's for Wan 2.1, from tiny_decoder_path)
    # tiny is an opt-in fast path: another model, its frames not the VAE's; recorded in settings_used
    tiny_decoder_path: str = ""  # the TAEHV weights for Wan 2.1 (taew2_1.pth or .safetensors) that decoder=tiny reads
    split_decode: bool = True  # SP ranks share each block's decode, a band of image rows each (else the owner's)
    cpu_vae_kernels: str = "onednn"  # the VAE's float32 CPU convolutions (condition encode, decode): onednn (~5x
    # faster) or torch (torch's own for both, ~5x slower; their condition latents differ from onednn's in the last
    # bits, so a CPU float32 recording replays bit for bit only on the kernels it was made with: docs/replay.md)
    compile: bool = False  # torch.compile each transformer block: faster; close to eager, not bit-identical
    kv_reuse: bool = False  # a fast path: a block's history is the K/V its last DMD step wrote (its noisy input at
    # that step's timestep) instead of a clean-KV commit forward's: 4 forwards a block, not 5; other latents

    @property
    def forwards_per_block(self) -> int:
        """Transformer forwards of one block: the DMD steps, plus the commit forward unless kv_reuse."""
        return self.denoise_steps + (0 if self.kv_reuse else 1)
