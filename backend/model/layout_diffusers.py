"""The diffusers download, `robbyant/lingbot-world-v2-14b-causal-fast-diffusers`: model_index.json, transformer/,
vae/ (AutoencoderKLWan), text_encoder/ (UMT5EncoderModel), tokenizer/, scheduler/ (optional).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..api.contract import BLOCK_FRAMES
from .config import read_json
from .layout import CheckpointLayout, Layout, Setting

if TYPE_CHECKING:  # the layout and its configs are read without torch (the launcher's start-up check); its
    import torch  # loaders import what they build with

# transformer/config.json key -> the setting it names
TRANSFORMER_SETTINGS = {"local_attn_size": "window_frames", "sink_size": "sink_frames"}


def vae_config(checkpoint: CheckpointLayout) -> dict:
    return read_json(checkpoint.vae / "config.json")


def file_settings(checkpoint: CheckpointLayout) -> dict[str, Setting]:
    """What transformer/config.json (local_attn_size, sink_size) and scheduler/scheduler_config.json (shift) name."""
    config_file = checkpoint.transformer / "config.json"
    transformer = read_json(config_file)
    settings = {name: Setting(int(transformer[key]), f"checkpoint file {config_file} {key}")
                for key, name in TRANSFORMER_SETTINGS.items() if transformer.get(key) is not None}
    scheduler = checkpoint.root / "scheduler" / "scheduler_config.json"
    if scheduler.is_file() and "shift" in (raw := read_json(scheduler)):
        settings["timestep_shift"] = Setting(float(raw["shift"]), f"checkpoint file {scheduler} shift")
    return settings


def load_vae(checkpoint: CheckpointLayout, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    from diffusers import AutoencoderKLWan

    vae = AutoencoderKLWan.from_pretrained(str(checkpoint.vae), torch_dtype=dtype, low_cpu_mem_usage=False)
    return vae.to(device).eval()


def load_text_encoder(checkpoint: CheckpointLayout, dtype: torch.dtype,
                      device: torch.device) -> tuple[torch.nn.Module, object]:
    from transformers import UMT5EncoderModel

    from .checkpoint import load_tokenizer

    tokenizer = load_tokenizer(checkpoint.tokenizer)
    # Eager attention is the reference T5Encoder's math bit for bit (float32 and bfloat16); SDPA, the default, is not.
    encoder = UMT5EncoderModel.from_pretrained(str(checkpoint.text_encoder), dtype=dtype, attn_implementation="eager")
    return encoder.to(device).eval(), tokenizer


DIFFUSERS = Layout(
    name="diffusers",
    parts={
        "index": "model_index.json",
        "transformer": "transformer",
        "vae": "vae",
        "text_encoder": "text_encoder",
        "tokenizer": "tokenizer",
    },
    source_defaults={
        "block_frames": Setting(BLOCK_FRAMES, "diffusers layout default (3 latent frames per block)"),
        "timestep_shift": Setting(5.0, "diffusers layout default (no shift in scheduler/scheduler_config.json)"),
        "window_frames": Setting(18, "diffusers layout default (no local_attn_size in transformer/config.json)"),
        "sink_frames": Setting(9, "diffusers layout default (no sink_size in transformer/config.json)"),
    },
    vae_config=vae_config,
    file_settings=file_settings,
    load_vae=load_vae,
    load_text_encoder=load_text_encoder,
)
