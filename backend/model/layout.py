"""Which download a checkpoint directory holds, where its parts are, and its source's settings (torch-free).

Official (`robbyant/lingbot-world-v2-14b-causal-fast`, read by the reference's wan/image2video.py):
    transformers/ (config.json + safetensors), Wan2.1_VAE.pth, models_t5_umt5-xxl-enc-bf16.pth, google/umt5-xxl/
Diffusers (`robbyant/lingbot-world-v2-14b-causal-fast-diffusers`):
    model_index.json, transformer/, vae/, text_encoder/, tokenizer/, scheduler/ (optional)
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..api.contract import BLOCK_FRAMES
from ..api.errors import ConfigError

OFFICIAL = "official"
DIFFUSERS = "diffusers"

# The parts each layout must have, by path relative to the checkpoint directory.
OFFICIAL_PARTS = {
    "transformer": "transformers",  # wan/configs/wan_i2v_A14B.py fast_checkpoint
    "vae": "Wan2.1_VAE.pth",  # vae_checkpoint
    "text_encoder": "models_t5_umt5-xxl-enc-bf16.pth",  # t5_checkpoint
    "tokenizer": "google/umt5-xxl",  # t5_tokenizer
}
DIFFUSERS_PARTS = {
    "index": "model_index.json",
    "transformer": "transformer",
    "vae": "vae",
    "text_encoder": "text_encoder",
    "tokenizer": "tokenizer",
}
LAYOUT_PARTS = {OFFICIAL: OFFICIAL_PARTS, DIFFUSERS: DIFFUSERS_PARTS}


@dataclass(frozen=True)
class Setting:
    value: float | int
    source: str  # where the value comes from: a parameter, a checkpoint file, a source default


# Each layout's settings when neither a parameter nor a checkpoint file names them, with where they come from.
SOURCE_DEFAULTS: dict[str, dict[str, Setting]] = {
    OFFICIAL: {
        "block_frames": Setting(4, "official script default (generate.py --chunk_size)"),
        "timestep_shift": Setting(10.0, "official script default (wan/configs/wan_i2v_A14B.py sample_shift, "
                                              "generate.py --sample_shift)"),
        "window_frames": Setting(18, "official script default (run_fast.sh --local_attn_size)"),
        "sink_frames": Setting(6, "official script default (run_fast.sh --sink_size)"),
    },
    DIFFUSERS: {
        "block_frames": Setting(BLOCK_FRAMES, "diffusers layout default (3 latent frames per block)"),
        "timestep_shift": Setting(5.0, "diffusers layout default (no shift in scheduler/scheduler_config.json)"),
        "window_frames": Setting(18, "diffusers layout default (no local_attn_size in transformer/config.json)"),
        "sink_frames": Setting(9, "diffusers layout default (no sink_size in transformer/config.json)"),
    },
}


@dataclass(frozen=True)
class CheckpointLayout:
    kind: str  # OFFICIAL or DIFFUSERS
    root: Path
    transformer: Path  # config.json + safetensors (single or sharded with an index)
    vae: Path  # Wan2.1_VAE.pth, or the AutoencoderKLWan directory
    text_encoder: Path  # models_t5_umt5-xxl-enc-bf16.pth, or the UMT5EncoderModel directory
    tokenizer: Path

    @property
    def official(self) -> bool:
        return self.kind == OFFICIAL


def resolve_layout(checkpoint: str) -> CheckpointLayout:
    """Detect the layout from the files; a directory with part of one layout is refused, naming what it lacks."""
    root = Path(checkpoint)
    if not root.is_dir():
        raise ConfigError(f"checkpoint directory {root} does not exist")
    missing = {kind: sorted(p for p in parts.values() if not (root / p).exists()) for kind, parts in LAYOUT_PARTS.items()}
    complete = [kind for kind in LAYOUT_PARTS if not missing[kind]]
    if len(complete) == 2:
        raise ConfigError(f"checkpoint {root} holds both the official and the diffusers layout; point it at one")
    if not complete:
        kind = min(LAYOUT_PARTS, key=lambda k: len(missing[k]) / len(LAYOUT_PARTS[k]))
        if len(missing[kind]) == len(LAYOUT_PARTS[kind]):
            raise ConfigError(
                f"checkpoint {root} holds neither layout: the official download has "
                f"{sorted(OFFICIAL_PARTS.values())}, the diffusers one {sorted(DIFFUSERS_PARTS.values())}"
            )
        present = sorted(set(LAYOUT_PARTS[kind].values()) - set(missing[kind]))
        raise ConfigError(f"checkpoint {root} is a partial {kind} layout (has {present}): missing {missing[kind]}")
    kind = complete[0]
    parts = {k: root / LAYOUT_PARTS[kind][k] for k in ("transformer", "vae", "text_encoder", "tokenizer")}
    return CheckpointLayout(kind, root, **parts)
