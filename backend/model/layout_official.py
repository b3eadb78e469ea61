"""The official download, `robbyant/lingbot-world-v2-14b-causal-fast`, as the reference's wan/image2video.py reads it:
transformers/ (config.json + safetensors), Wan2.1_VAE.pth, models_t5_umt5-xxl-enc-bf16.pth, google/umt5-xxl/.
The VAE and the umT5 are state dicts under Wan's own names (`official_names` maps them onto the served classes).
"""
from __future__ import annotations

import inspect
from pathlib import Path
from typing import TYPE_CHECKING

from ..api.errors import ConfigError
from .layout import CheckpointLayout, Layout, Setting
from .official_names import UMT5_TIED, umt5_arguments, umt5_names, vae_arguments, vae_names
from .pth_files import read_pth_index

if TYPE_CHECKING:  # the layout and its configs are read without torch (the launcher's start-up check); its
    import torch  # loaders import what they build with


def vae_config(checkpoint: CheckpointLayout) -> dict:
    """Wan2.1_VAE.pth's architecture, from its tensor names and shapes (no tensor data read)."""
    return vae_arguments(read_pth_index(checkpoint.vae), checkpoint.vae)


def file_settings(checkpoint: CheckpointLayout) -> dict[str, Setting]:
    """None: its settings are its scripts' (the reference passes window and sink at load time, over config.json's)."""
    return {}


def load_vae(checkpoint: CheckpointLayout, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    return load_pth_vae(checkpoint.vae, dtype, device)


def load_text_encoder(checkpoint: CheckpointLayout, dtype: torch.dtype,
                      device: torch.device) -> tuple[torch.nn.Module, object]:
    from .checkpoint import load_tokenizer

    tokenizer = load_tokenizer(checkpoint.tokenizer)
    return load_pth_umt5(checkpoint.text_encoder, dtype, device), tokenizer


def load_pth_vae(path: Path, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """AutoencoderKLWan from Wan's own VAE state dict (Wan2.1_VAE.pth), its architecture read from the names."""
    import torch
    from diffusers import AutoencoderKLWan

    from .checkpoint import fill_from_pth

    index = read_pth_index(path)
    arguments = vae_arguments(index, path)
    wan21_mean = inspect.signature(AutoencoderKLWan.__init__).parameters["latents_mean"].default
    if arguments["z_dim"] != len(wan21_mean):
        raise ConfigError(
            f"{path}: z_dim {arguments['z_dim']}; the official layout carries no latent statistics, and "
            f"Wan 2.1's (AutoencoderKLWan's defaults) are for z_dim {len(wan21_mean)}"
        )
    with torch.device("meta"):
        vae = AutoencoderKLWan(**arguments)  # latents_mean / latents_std: Wan 2.1's, as Wan2_1_VAE hard-codes
    fill_from_pth(vae, path, index, vae_names(vae), dtype, device)
    return vae.eval().requires_grad_(False)


def load_pth_umt5(path: Path, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """UMT5EncoderModel from Wan's own umT5 encoder state dict, its architecture read from the names."""
    import torch
    from transformers import UMT5Config, UMT5EncoderModel

    from .checkpoint import assign, fill_from_pth

    index = read_pth_index(path)
    with torch.device("meta"):
        encoder = UMT5EncoderModel(UMT5Config(**umt5_arguments(index, path), attn_implementation="eager"))
    fill_from_pth(encoder, path, index, umt5_names(encoder), dtype, device)
    for tied, source in UMT5_TIED.items():
        assign(encoder, tied, encoder.get_parameter(source))
    return encoder.eval().requires_grad_(False)


OFFICIAL = Layout(
    name="official",
    parts={
        "transformer": "transformers",  # wan/configs/wan_i2v_A14B.py fast_checkpoint
        "vae": "Wan2.1_VAE.pth",  # vae_checkpoint
        "text_encoder": "models_t5_umt5-xxl-enc-bf16.pth",  # t5_checkpoint
        "tokenizer": "google/umt5-xxl",  # t5_tokenizer
    },
    source_defaults={
        "block_frames": Setting(4, "official script default (generate.py --chunk_size)"),
        "timestep_shift": Setting(10.0, "official script default (wan/configs/wan_i2v_A14B.py sample_shift, "
                                        "generate.py --sample_shift)"),
        "window_frames": Setting(18, "official script default (run_fast.sh --local_attn_size)"),
        "sink_frames": Setting(6, "official script default (run_fast.sh --sink_size)"),
    },
    vae_config=vae_config,
    file_settings=file_settings,
    load_vae=load_vae,
    load_text_encoder=load_text_encoder,
)
