"""The DiT's forward on the tiny geometry: shapes, a rolling window, text K/V per head shard, RoPE positions."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from backend.model.attention import sdpa_attention
from backend.model.config import TransformerConfig
from backend.model.kv_cache import SelfAttentionCache
from backend.model.rope import rope_tables
from backend.model.transformer import ForwardContext, LingBotTransformer
from backend.parallel.sequence import SequenceParallel

CONFIG = TransformerConfig(dim=64, ffn_dim=128, num_heads=2, num_layers=2, in_dim=36, out_dim=16, text_dim=32,
                           freq_dim=256, text_len=16, local_attn_size=6, sink_size=3)


@pytest.fixture(scope="module")
def model() -> LingBotTransformer:
    torch.manual_seed(0)
    return LingBotTransformer(CONFIG).eval()


@pytest.mark.parametrize("batch", [1, 2])
def test_forward_through_a_rolling_window(model: LingBotTransformer, batch: int) -> None:
    f, h, w = 3, 4, 6
    tokens_per_frame = (h // 2) * (w // 2)
    caches = [SelfAttentionCache(CONFIG.num_layers, CONFIG.local_attn_size * tokens_per_frame, f * tokens_per_frame,
                                 CONFIG.sink_size * tokens_per_frame, CONFIG.num_heads, CONFIG.head_dim,
                                 torch.float32, torch.device("cpu")) for _ in range(batch)]
    text = [model.text_caches(torch.randn(1, 5, CONFIG.text_dim), slice(0, CONFIG.num_heads)) for _ in range(batch)]
    for block in range(3):  # the third block evicts: 6 + 3 frames > a 6-frame window
        for cache in caches:
            cache.make_room()
        cos, sin = rope_tables(CONFIG.head_dim, block * f, f, h // 2, w // 2)
        ctx = ForwardContext(SequenceParallel(), sdpa_attention, cos[None].expand(batch, -1, -1),
                             sin[None].expand(batch, -1, -1), caches, text)
        with torch.no_grad():
            out = model(torch.randn(batch, CONFIG.in_dim, f, h, w), torch.randn(batch, 384, f, h, w),
                        torch.full((batch, f), 999.0), tokens_per_frame, ctx)
        assert out.shape == (batch, CONFIG.out_dim, f, h, w) and out.dtype == torch.float32
        assert torch.isfinite(out).all()
        for cache in caches:
            cache.commit()
    assert caches[0].length == CONFIG.local_attn_size * tokens_per_frame and caches[0].evicted_tokens > 0


def test_text_keys_are_per_head_shard_and_zero_padded(model: LingBotTransformer) -> None:
    states = torch.randn(1, 5, CONFIG.text_dim)
    with torch.no_grad():
        full = model.text_caches(states, slice(0, 2))
        second = model.text_caches(F.pad(states, (0, 0, 0, CONFIG.text_len - 5)), slice(1, 2))
    assert full.keys[0].shape == (1, CONFIG.text_len, 2, CONFIG.head_dim)
    torch.testing.assert_close(second.keys[1], full.keys[1][:, :, 1:2])
    torch.testing.assert_close(second.values[0], full.values[0][:, :, 1:2])


def test_rope_splits_44_42_42_at_absolute_frames() -> None:
    cos, _ = rope_tables(128, 5, 2, 3, 4)
    assert cos.shape == (24, 64) and cos.dtype == torch.float64
    again, _ = rope_tables(128, 0, 7, 3, 4)
    assert torch.equal(cos, again[5 * 12:])  # frame 5 of a later block is frame 5 of the clip
    # Height and width pairs (the last 42 of 64) do not depend on the frame.
    assert torch.equal(again[:12, 22:], again[12:24, 22:])


def test_compiled_blocks_share_graphs_across_layers() -> None:
    """Each block sees its own layer's caches, not a layer index: 12 layers (more than dynamo's recompile limit
    of 8) and three blocks through the window trace a handful of graphs, not one per layer."""
    config = dataclasses.replace(CONFIG, num_layers=12)
    torch.manual_seed(0)
    model = LingBotTransformer(config).eval()
    graphs = []

    def count(gm: torch.fx.GraphModule, _inputs: list) -> torch.fx.GraphModule:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    for block in model.blocks:
        block.compile(backend=count, dynamic=True)
    f, h, w = 3, 4, 6
    tpf = (h // 2) * (w // 2)
    cache = SelfAttentionCache(config.num_layers, config.local_attn_size * tpf, f * tpf, config.sink_size * tpf,
                               config.num_heads, config.head_dim, torch.float32, torch.device("cpu"))
    text = [model.text_caches(torch.randn(1, 5, config.text_dim), slice(0, config.num_heads))]
    for index in range(3):
        cache.make_room()
        cos, sin = rope_tables(config.head_dim, index * f, f, h // 2, w // 2)
        ctx = ForwardContext(SequenceParallel(), sdpa_attention, cos[None], sin[None], [cache], text)
        with torch.no_grad():
            model(torch.randn(1, config.in_dim, f, h, w), torch.randn(1, 384, f, h, w), torch.full((1, f), 999.0),
                  tpf, ctx)
        cache.commit()
    torch._dynamo.reset()
    assert 0 < len(graphs) <= 4, len(graphs)


def test_the_camera_branch_runs_once_a_block_and_gives_the_same_bits(model: LingBotTransformer) -> None:
    """A block's forwards (its DMD steps and the commit, one context) make its camera modulation once; their
    outputs are bit-identical to forwards that each make it (a context per forward, as the reference does); a
    forward on other camera features makes their own."""
    f, h, w = 3, 4, 6
    tpf = (h // 2) * (w // 2)
    generator = torch.Generator().manual_seed(5)
    latents = [torch.randn(1, CONFIG.in_dim, f, h, w, generator=generator) for _ in range(5)]
    camera, other_camera = (torch.randn(1, 384, f, h, w, generator=generator) for _ in range(2))
    text = [model.text_caches(torch.randn(1, 5, CONFIG.text_dim, generator=generator), slice(0, CONFIG.num_heads))]
    cos, sin = rope_tables(CONFIG.head_dim, 0, f, h // 2, w // 2)

    def context() -> ForwardContext:
        cache = SelfAttentionCache(CONFIG.num_layers, CONFIG.local_attn_size * tpf, f * tpf, CONFIG.sink_size * tpf,
                                   CONFIG.num_heads, CONFIG.head_dim, torch.float32, torch.device("cpu"))
        cache.make_room()
        return ForwardContext(SequenceParallel(), sdpa_attention, cos[None], sin[None], [cache], text)

    calls = []
    hooks = [layer.register_forward_hook(lambda m, _i, _o: calls.append(m))
             for layer in (model.patch_embedding_wancamctrl, *(b.cam_injector_layer1 for b in model.blocks),
                           *(b.cam_scale_layer for b in model.blocks))]
    try:
        with torch.no_grad():
            block = context()
            once = [model(x, camera, torch.full((1, f), t), tpf, block) for x, t in zip(latents, (999, 937, 833, 624, 0))]
            assert len(calls) == 1 + 2 * CONFIG.num_layers  # the first forward's, not again
            each = [model(x, camera, torch.full((1, f), t), tpf, context())
                    for x, t in zip(latents, (999, 937, 833, 624, 0))]
            assert len(calls) == 6 * (1 + 2 * CONFIG.num_layers)
            other = model(latents[0], other_camera, torch.full((1, f), 999), tpf, block)
            assert len(calls) == 7 * (1 + 2 * CONFIG.num_layers)
            expected_other = model(latents[0], other_camera, torch.full((1, f), 999), tpf, context())
    finally:
        for hook in hooks:
            hook.remove()
    for a, b in zip(once, each):
        assert torch.equal(a, b)
    assert torch.equal(other, expected_other) and not torch.equal(other, once[0])
