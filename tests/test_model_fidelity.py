"""Bit for bit with the reference: the VAE's latent scale and the umT5 text encoder.

The expected values are computed here from the reference's formulas (Wan's vae2_1.py scale, Wan's t5.py
T5Encoder), not through the server's code path, so a change of scale order or attention kernel fails.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLWan

from backend.model.layout import CheckpointLayout
from backend.model.layout_diffusers import DIFFUSERS
from backend.model.text_encoder import PromptEncoder
from backend.model.tiny_checkpoint import PRESETS, WORDS, write_text_encoder
from backend.model.vae import StreamingVae

CPU = torch.device("cpu")


def to_uint8(video: torch.Tensor) -> np.ndarray:
    """[3, n, H, W] in [-1, 1] -> uint8 [n, H, W, 3], rounded as the server does."""
    return ((video.clamp(-1.0, 1.0) + 1.0) * 127.5).round().to(torch.uint8).permute(1, 2, 3, 0).numpy()


def test_vae_decode_uses_the_reference_latent_scale() -> None:
    torch.manual_seed(0)
    z = 4
    vae = AutoencoderKLWan(base_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, z_dim=z,
                           temperal_downsample=[False, True, True],
                           latents_mean=[0.1, -0.2, 0.3, -0.4], latents_std=[1.3, 0.7, 2.9, 1.1]).eval()
    latents = torch.randn(1, z, 3, 16, 16, generator=torch.Generator().manual_seed(3))
    mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1)
    scale = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1)  # the reference's scale[1]
    streaming = StreamingVae(vae, CPU)  # first: it may switch the decoder's kernels (cpu_vae), for both decodes
    with torch.no_grad():
        expected = to_uint8(vae.decode(latents / scale + mean).sample[0])  # WanVAE_.decode: z / scale[1] + scale[0]
        other_order = to_uint8(vae.decode(latents * torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1)
                                          + mean).sample[0])
    assert not np.array_equal(expected, other_order)  # this case tells the two orders apart

    frames = streaming.decode_block(latents, streaming.new_decode_state())
    assert frames.shape == (9, 128, 128, 3)
    np.testing.assert_array_equal(frames, expected)


# The reference's T5Encoder (Wan's t5.py), written out over a UMT5EncoderModel's weights.

def relative_bucket(rel: torch.Tensor, num_buckets: int, max_dist: int) -> torch.Tensor:
    half = num_buckets // 2  # bidirectional
    buckets = (rel > 0).long() * half
    rel = rel.abs()
    exact = half // 2
    large = exact + (torch.log(rel.float() / exact) / math.log(max_dist / exact) * (half - exact)).long()
    large = torch.min(large, torch.full_like(large, half - 1))
    return buckets + torch.where(rel < exact, rel, large)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x * torch.rsqrt(x.float().pow(2).mean(dim=-1, keepdim=True) + eps)
    if weight.dtype in (torch.float16, torch.bfloat16):
        x = x.type_as(weight)
    return weight * x


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


@torch.no_grad()
def reference_t5_encoder(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    config, encoder = model.config, model.encoder
    b, length = ids.shape
    n, c, eps = config.num_heads, config.d_kv, config.layer_norm_epsilon
    rel = torch.arange(length)[None, :] - torch.arange(length)[:, None]
    buckets = relative_bucket(rel, config.relative_attention_num_buckets, config.relative_attention_max_distance)
    x = encoder.embed_tokens(ids)
    for block in encoder.block:
        attn, ffn = block.layer[0].SelfAttention, block.layer[1].DenseReluDense
        h = rms_norm(x, block.layer[0].layer_norm.weight, eps)
        q, k, v = (proj(h).view(b, -1, n, c) for proj in (attn.q, attn.k, attn.v))
        bias = h.new_zeros(b, n, length, length)
        bias += attn.relative_attention_bias(buckets).permute(2, 0, 1)[None]
        bias.masked_fill_(mask.view(b, 1, 1, -1) == 0, torch.finfo(h.dtype).min)
        scores = torch.einsum("binc,bjnc->bnij", q, k) + bias  # no scaling in T5
        weights = torch.softmax(scores.float(), dim=-1).type_as(scores)
        x = x + attn.o(torch.einsum("bnij,bjnc->binc", weights, v).reshape(b, -1, n * c))
        h = rms_norm(x, block.layer[1].layer_norm.weight, eps)
        x = x + ffn.wo(ffn.wi_1(h) * gelu_tanh(ffn.wi_0(h)))
    return rms_norm(x, encoder.final_layer_norm.weight, eps)


@pytest.fixture(scope="module")
def text_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("umt5")
    write_text_encoder(root, PRESETS["tiny"], seed=2)
    return root


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_text_encoder_equals_the_reference_t5_encoder(text_root: Path, dtype: torch.dtype) -> None:
    text_len, prompt = 64, " ".join(WORDS[:20])
    layout = CheckpointLayout(DIFFUSERS, text_root, text_root / "transformer", text_root / "vae",
                              text_root / "text_encoder", text_root / "tokenizer")
    encoder, tokenizer = layout.load_text_encoder(dtype, CPU)
    states = PromptEncoder(encoder, tokenizer, text_len, CPU).encode(prompt)

    batch = tokenizer([prompt], padding="max_length", truncation=True, max_length=text_len,
                      add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
    real = int(batch.attention_mask.sum())
    expected = reference_t5_encoder(encoder, batch.input_ids, batch.attention_mask)
    assert states.shape == (1, text_len, encoder.config.d_model) and states.dtype == dtype
    assert torch.equal(states[0, :real], expected[0, :real])
    assert torch.all(states[0, real:] == 0)
