"""The published layout: the 14B module tree's names and shapes, config keys, shard-by-shard loading."""
from __future__ import annotations

import json
import logging
import weakref
from pathlib import Path

import pytest
import torch

from backend.api.errors import ConfigError
from backend.model import checkpoint
from backend.model.config import TransformerConfig
from backend.model.tiny_checkpoint import PRESETS, write_sharded
from backend.model.transformer import LingBotTransformer

MANIFEST = Path(__file__).parent / "data" / "lingbot_v2_14b_transformer_keys.json"

# What the reference class's save_config writes (patch_size, qk_norm, cross_attn_norm, text_dim are not saved).
REFERENCE_JSON = {
    "_class_name": "WanModelFast", "_diffusers_version": "0.35.1", "model_type": "i2v", "text_len": 512,
    "in_dim": 36, "dim": 5120, "ffn_dim": 13824, "freq_dim": 256, "out_dim": 16, "num_heads": 40,
    "num_layers": 40, "local_attn_size": -1, "sink_size": 0, "eps": 1e-06,
}


def test_14b_on_the_meta_device_has_the_published_names_and_shapes() -> None:
    manifest = json.loads(MANIFEST.read_text())
    with torch.device("meta"):
        model = LingBotTransformer(TransformerConfig.lingbot_14b())
    ours = {k: list(v.shape) for k, v in model.state_dict().items()}
    assert len(ours) == len(manifest) == 1421
    assert sorted(set(ours) ^ set(manifest)) == []
    assert {k: v for k, v in ours.items() if manifest[k] != v} == {}
    assert sum(v.numel() for v in model.state_dict().values()) == pytest.approx(18.54e9, rel=1e-3)


def test_reference_config_keys_with_the_omitted_defaults() -> None:
    cfg = TransformerConfig.from_dict(REFERENCE_JSON, text_dim=4096, local_attn_size=18, sink_size=6)
    assert cfg == TransformerConfig.lingbot_14b()
    cfg = TransformerConfig.from_dict(REFERENCE_JSON)
    assert (cfg.patch_size, cfg.qk_norm, cfg.cross_attn_norm, cfg.text_dim) == ((1, 2, 2), True, True, 4096)
    assert TransformerConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_diffusers_style_keys() -> None:
    raw = {"_class_name": "WanTransformer3DModel", "num_attention_heads": 40, "attention_head_dim": 128,
           "in_channels": 36, "out_channels": 16, "num_layers": 40, "ffn_dim": 13824, "freq_dim": 256,
           "text_dim": 4096, "eps": 1e-6, "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads",
           "patch_size": [1, 2, 2]}
    assert TransformerConfig.from_dict(raw, local_attn_size=18, sink_size=6) == TransformerConfig.lingbot_14b()


def test_missing_key_is_named_and_unknown_keys_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ConfigError, match="ffn_dim"):
        TransformerConfig.from_dict({k: v for k, v in REFERENCE_JSON.items() if k != "ffn_dim"})
    with pytest.raises(ConfigError, match="attention_head_dim"):
        TransformerConfig.from_dict({**REFERENCE_JSON, "num_attention_heads": 40})
    log = logging.getLogger("config-test")
    with caplog.at_level(logging.WARNING, logger="config-test"):
        TransformerConfig.from_dict({**REFERENCE_JSON, "rope_max_seq_len": 1024, "image_dim": None}, log)
    assert "rope_max_seq_len" in caplog.text and "image_dim" in caplog.text


def test_text_dim_comes_from_the_weights_when_the_config_omits_it(tiny_checkpoint: str, tmp_path: Path) -> None:
    import shutil

    from backend.model.config import read_checkpoint_configs
    from backend.model.layouts import resolve_layout

    root = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, root)
    path = root / "transformer" / "config.json"
    raw = json.loads(path.read_text())
    del raw["text_dim"]
    path.write_text(json.dumps(raw))
    assert read_checkpoint_configs(resolve_layout(str(root))).transformer.text_dim == PRESETS["tiny"]["transformer"]["text_dim"]


@pytest.fixture()
def fp32_shards(tmp_path: Path) -> tuple[Path, TransformerConfig]:
    cfg = TransformerConfig(**PRESETS["tiny"]["transformer"], in_dim=12, out_dim=4)
    torch.manual_seed(0)
    write_sharded(LingBotTransformer(cfg).state_dict(), tmp_path, shards=4)
    return tmp_path, cfg


def test_fp32_shards_load_into_bf16_one_tensor_at_a_time(fp32_shards, monkeypatch: pytest.MonkeyPatch) -> None:
    directory, cfg = fp32_shards
    live: dict[int, int] = {}
    peak = [0]
    real_read = checkpoint.read_tensor

    def watched(*args) -> torch.Tensor:
        """read_tensor, recording every FP32 tensor it hands out until the tensor is freed."""
        tensor = real_read(*args)
        assert tensor.dtype == torch.float32
        live[id(tensor)] = tensor.numel()
        weakref.finalize(tensor, live.pop, id(tensor), None)
        peak[0] = max(peak[0], len(live))
        return tensor

    monkeypatch.setattr(checkpoint, "read_tensor", watched)
    model = checkpoint.load_transformer(directory, cfg, torch.bfloat16, torch.device("cpu"))
    assert peak[0] == 1 and not live  # never more than one FP32 tensor alive, let alone one shard's
    assert all(p.dtype == torch.bfloat16 and not p.is_meta for p in model.parameters())


def test_bad_shards_are_named(fp32_shards) -> None:
    directory, cfg = fp32_shards
    victim = sorted(directory.glob("*-00002-of-*.safetensors"))[0]
    victim.write_bytes(victim.read_bytes()[:100])
    with pytest.raises(ConfigError, match=victim.name):
        checkpoint.load_transformer(directory, cfg, torch.bfloat16, torch.device("cpu"))
    victim.unlink()
    with pytest.raises(ConfigError, match=f"not found: .*{victim.name}"):
        checkpoint.load_transformer(directory, cfg, torch.bfloat16, torch.device("cpu"))
