"""Write a random checkpoint in the diffusers directory format the engine loads (weights can't be downloaded).

    python -m backend.model.tiny_checkpoint OUT_DIR [--preset tiny|tiny16|wide|mid] [--seed 0] [--if-stale]

Same layout as a real checkpoint: model_index.json, transformer/ (config.json + safetensors),
vae/ (AutoencoderKLWan), text_encoder/ (UMT5EncoderModel), tokenizer/, scheduler/.
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..api.errors import ConfigError
from .config import TransformerConfig, read_checkpoint_configs
from .layouts import resolve_layout
from .transformer import LingBotTransformer
from .weight_files import WEIGHTS_INDEX_NAME, WEIGHTS_NAME, shard_plan

# CI size: 4 heads (SP 1/2/4), 64x64 video -> 8x8 latents -> 16 tokens per frame; a 9-frame window.
TINY: dict = {
    "transformer": dict(num_heads=4, dim=64, text_dim=32, freq_dim=32, ffn_dim=128, num_layers=2, text_len=16,
                        local_attn_size=9, sink_size=3),
    "vae": dict(base_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1),
    "z_dim": 4,
    "text_encoder": dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4),
}

PRESETS: dict[str, dict] = {
    "tiny": TINY,
    # The tiny model with the Wan VAE's 16 latent channels and Wan 2.1's latent statistics (AutoencoderKLWan's
    # defaults): what the official layout can carry, which names no statistics (see official_checkpoint).
    "tiny16": TINY | {"z_dim": 16, "wan21_latents": True},
    # The tiny model made wide (367 MB of float32 transformer weights): large enough that a process freeing its
    # weights shows in its RSS (bench.kill_matrix).
    "wide": TINY | {"transformer": TINY["transformer"] | dict(num_heads=8, dim=1024, ffn_dim=4096, num_layers=4)},
    # GPU benchmark size: the real 40-head geometry, a fraction of the depth and width.
    "mid": {
        "transformer": dict(num_heads=40, dim=2560, text_dim=512, freq_dim=256, ffn_dim=6912, num_layers=8,
                            text_len=512, local_attn_size=18, sink_size=6),
        "vae": dict(base_dim=32, dim_mult=[1, 2, 2, 2], num_res_blocks=1),
        "z_dim": 16,
        "wan21_latents": True,
        "text_encoder": dict(d_model=512, d_kv=64, d_ff=1024, num_layers=2, num_heads=8),
    },
}

WORDS = (
    "a the of and in on with to from at by is are walking flying driving camera forward left right street city "
    "forest mountain river sea sky sunset night rain snow road car house tree people light dark castle village "
    "desert cave bridge tower garden field ocean beach cloud fog"
).split()


def write_sharded(state: dict[str, torch.Tensor], out: Path, shards: int) -> None:
    """Safetensors shards plus their index, in diffusers' naming (one plain file when shards == 1)."""
    names = list(state)
    per_shard = -(-len(names) // shards)
    groups = [names[i : i + per_shard] for i in range(0, len(names), per_shard)]
    if len(groups) == 1:
        save_file({k: state[k].contiguous() for k in names}, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
        return
    stem, ext = WEIGHTS_NAME.rsplit(".", 1)
    weight_map = {}
    for i, group in enumerate(groups):
        file = f"{stem}-{i + 1:05d}-of-{len(groups):05d}.{ext}"
        save_file({k: state[k].contiguous() for k in group}, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(group, file))
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2))


def transformer_config(preset: dict) -> TransformerConfig:
    """A preset's DiT config: noise + 4 mask + condition channels in, z_dim out."""
    z = preset["z_dim"]
    return TransformerConfig(**preset["transformer"], in_dim=2 * z + 4, out_dim=z)


def vae_arguments(preset: dict) -> dict:
    """A preset's `AutoencoderKLWan` architecture (without latents_mean / latents_std)."""
    return {**preset["vae"], "z_dim": preset["z_dim"], "temperal_downsample": [False, True, True]}


def write_transformer(out: Path, preset: dict, seed: int) -> TransformerConfig:
    config = transformer_config(preset)
    torch.manual_seed(seed)
    model = LingBotTransformer(config)
    out.mkdir(parents=True, exist_ok=True)
    write_sharded(model.state_dict(), out, shards=3)
    meta = {"_class_name": "WanModelFast", "_diffusers_version": "0.35.1", **config.to_dict()}
    (out / "config.json").write_text(json.dumps(meta, indent=2))
    return config


def write_vae(out: Path, preset: dict, seed: int) -> None:
    from diffusers import AutoencoderKLWan

    z = preset["z_dim"]
    g = torch.Generator().manual_seed(seed)
    stats = {} if preset.get("wan21_latents") else {
        "latents_mean": (torch.randn(z, generator=g) * 0.1).tolist(),
        "latents_std": (1.0 + torch.rand(z, generator=g) * 0.5).tolist(),
    }
    torch.manual_seed(seed)
    AutoencoderKLWan(**vae_arguments(preset), **stats).save_pretrained(str(out))


def write_text_encoder(root: Path, preset: dict, seed: int) -> None:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # its "Writing model shards" bar writes to stderr

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="</s>")
    tokenizer.save_pretrained(str(root / "tokenizer"))
    torch.manual_seed(seed)
    config = UMT5Config(vocab_size=len(vocab), relative_attention_num_buckets=8, **preset["text_encoder"])
    UMT5EncoderModel(config).save_pretrained(str(root / "text_encoder"))


def write_checkpoint(root: Path, preset_name: str = "tiny", seed: int = 0) -> Path:
    preset = PRESETS[preset_name]
    root.mkdir(parents=True, exist_ok=True)
    write_transformer(root / "transformer", preset, seed)
    write_vae(root / "vae", preset, seed + 1)
    write_text_encoder(root, preset, seed + 2)
    scheduler = {"_class_name": "FlowMatchEulerDiscreteScheduler", "_diffusers_version": "0.42.1",
                 "num_train_timesteps": 1000, "shift": 5.0}
    (root / "scheduler").mkdir(exist_ok=True)
    (root / "scheduler" / "scheduler_config.json").write_text(json.dumps(scheduler, indent=2))
    index = {
        "_class_name": "LingBotWorldCausalPipeline",
        "_diffusers_version": "0.42.1",
        "transformer": ["lingbot_world", "WanModelFast"],
        "vae": ["diffusers", "AutoencoderKLWan"],
        "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    }
    (root / "model_index.json").write_text(json.dumps(index, indent=2))
    return root


def ensure_current(root: Path, preset_name: str = "tiny", seed: int = 0) -> bool:
    """Write the checkpoint unless `root` holds one in today's layout (configs and weight names); True when
    written."""
    if not _is_current(root):
        if root.exists():
            shutil.rmtree(root)
        write_checkpoint(root, preset_name, seed)
        return True
    return False


def _is_current(root: Path) -> bool:
    try:
        config = read_checkpoint_configs(resolve_layout(str(root))).transformer
        stored = {name for names in shard_plan(root / "transformer").values() for name in names}
    except ConfigError:
        return False
    with torch.device("meta"):
        return set(LingBotTransformer(config).state_dict()) == stored


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--if-stale", action="store_true",
                        help="keep OUT when it already holds a checkpoint in the current layout")
    args = parser.parse_args()
    if args.if_stale:
        ensure_current(args.out, args.preset, args.seed)
    else:
        write_checkpoint(args.out, args.preset, args.seed)
    print(args.out)


if __name__ == "__main__":
    main()
