"""Causal Wan-style video DiT with camera conditioning, KV cache and Ulysses sequence parallelism.

Parameter names follow diffusers' `WanTransformer3DModel` (plus `camera_embedding.*`), so a
diffusers-format `transformer/` directory loads into it. Every rank holds all weights; hidden tokens
are split along the sequence, attention runs on head shards after an all-to-all.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from diffusers.models.attention import FeedForward
from diffusers.models.normalization import FP32LayerNorm
from diffusers.models.transformers.transformer_wan import WanTimeTextImageEmbedding
from torch import nn

from ..parallel.sequence import SequenceParallel
from .attention import AttentionFn
from .config import TransformerConfig
from .kv_cache import SelfAttentionCache, TextCache
from .rope import apply_rotary


@dataclass
class ForwardContext:
    """What one forward over a batch of sessions' current blocks needs besides the tensors."""

    sp: SequenceParallel
    attention: AttentionFn
    rope_cos: torch.Tensor  # [B, L/sp, head_dim/2], this rank's tokens
    rope_sin: torch.Tensor
    self_caches: list[SelfAttentionCache]
    text_caches: list[TextCache]


def patchify(x: torch.Tensor, patch: tuple[int, int, int]) -> torch.Tensor:
    """[B, C, F, H, W] -> [B, L, C*pt*ph*pw], tokens frame-major, features in Conv3d weight order."""
    b, c, f, h, w = x.shape
    pt, ph, pw = patch
    x = x.reshape(b, c, f // pt, pt, h // ph, ph, w // pw, pw)
    return x.permute(0, 2, 4, 6, 1, 3, 5, 7).reshape(b, (f // pt) * (h // ph) * (w // pw), c * pt * ph * pw)


def unpatchify(tokens: torch.Tensor, patch: tuple[int, int, int], grid: tuple[int, int, int]) -> torch.Tensor:
    """[B, L, pt*ph*pw*C] -> [B, C, F, H, W], the inverse of Wan's output head layout."""
    b = tokens.shape[0]
    pt, ph, pw = patch
    f, h, w = grid
    x = tokens.reshape(b, f, h, w, pt, ph, pw, -1)
    return x.permute(0, 7, 1, 4, 2, 5, 3, 6).reshape(b, -1, f * pt, h * ph, w * pw)


def conv_as_linear(conv: nn.Conv3d, tokens: torch.Tensor) -> torch.Tensor:
    """A stride == kernel Conv3d applied to patchified tokens (so it can run on a sequence shard)."""
    return F.linear(tokens, conv.weight.flatten(1), conv.bias)


class UlyssesAttention(nn.Module):
    """Wan attention projections; the core runs on head shards between two all-to-alls."""

    def __init__(self, dim: int, heads: int, eps: float) -> None:
        super().__init__()
        self.heads = heads
        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(dim, dim)
        self.to_v = nn.Linear(dim, dim)
        self.to_out = nn.ModuleList([nn.Linear(dim, dim)])
        self.norm_q = nn.RMSNorm(dim, eps=eps)
        self.norm_k = nn.RMSNorm(dim, eps=eps)

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (self.heads, -1))

    def project_out(self, ctx: ForwardContext, out_heads: torch.Tensor) -> torch.Tensor:
        return self.to_out[0](ctx.sp.heads_to_seq(out_heads).flatten(-2))


class SelfAttention(UlyssesAttention):
    def forward(self, x: torch.Tensor, ctx: ForwardContext, layer: int) -> torch.Tensor:
        q = apply_rotary(self.split_heads(self.norm_q(self.to_q(x))), ctx.rope_cos, ctx.rope_sin)
        k = apply_rotary(self.split_heads(self.norm_k(self.to_k(x))), ctx.rope_cos, ctx.rope_sin)
        v = self.split_heads(self.to_v(x))
        q, k, v = ctx.sp.seq_to_heads(torch.stack([q, k, v])).unbind(0)  # one all-to-all for q, k, v
        outs = []
        for i, cache in enumerate(ctx.self_caches):
            keys, values = cache.attend_over(layer, k[i : i + 1], v[i : i + 1])
            outs.append(ctx.attention(q[i : i + 1], keys, values))
        return self.project_out(ctx, torch.cat(outs))


class CrossAttention(UlyssesAttention):
    def text_kv(self, context: torch.Tensor, heads: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's heads of the prompt's K/V (the norm spans all heads, so project fully, then slice)."""
        k = self.split_heads(self.norm_k(self.to_k(context)))[:, :, heads].contiguous()
        v = self.split_heads(self.to_v(context))[:, :, heads].contiguous()
        return k, v

    def forward(self, x: torch.Tensor, ctx: ForwardContext, layer: int) -> torch.Tensor:
        q = ctx.sp.seq_to_heads(self.split_heads(self.norm_q(self.to_q(x))))
        outs = [
            ctx.attention(q[i : i + 1], cache.keys[layer], cache.values[layer])
            for i, cache in enumerate(ctx.text_caches)
        ]
        return self.project_out(ctx, torch.cat(outs))


class CausalWanBlock(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        dim = cfg.inner_dim
        self.norm1 = FP32LayerNorm(dim, cfg.eps, elementwise_affine=False)
        self.attn1 = SelfAttention(dim, cfg.num_attention_heads, cfg.eps)
        self.attn2 = CrossAttention(dim, cfg.num_attention_heads, cfg.eps)
        self.norm2 = FP32LayerNorm(dim, cfg.eps, elementwise_affine=True) if cfg.cross_attn_norm else nn.Identity()
        self.ffn = FeedForward(dim, inner_dim=cfg.ffn_dim, activation_fn="gelu-approximate")
        self.norm3 = FP32LayerNorm(dim, cfg.eps, elementwise_affine=False)
        self.scale_shift_table = nn.Parameter(torch.randn(1, 6, dim) / dim**0.5)

    def forward(self, h: torch.Tensor, modulation: torch.Tensor, ctx: ForwardContext, layer: int) -> torch.Tensor:
        """h: [B, L/sp, D]; modulation: [B, L/sp, 6, D] per-token timestep projection."""
        shift, scale, gate, c_shift, c_scale, c_gate = (self.scale_shift_table + modulation.float()).unbind(2)
        x = (self.norm1(h.float()) * (1 + scale) + shift).type_as(h)
        h = (h.float() + self.attn1(x, ctx, layer) * gate).type_as(h)
        x = self.norm2(h.float()).type_as(h)
        h = h + self.attn2(x, ctx, layer)
        x = (self.norm3(h.float()) * (1 + c_scale) + c_shift).type_as(h)
        return (h.float() + self.ffn(x).float() * c_gate).type_as(h)


class CameraEmbedding(nn.Module):
    """Pluecker maps -> hidden tokens: patch projection, SiLU, linear (added to the latent tokens)."""

    def __init__(self, camera_dim: int, dim: int, patch: tuple[int, int, int]) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv3d(camera_dim, dim, kernel_size=patch, stride=patch)
        self.proj = nn.Linear(dim, dim)

    def forward(self, camera_tokens: torch.Tensor) -> torch.Tensor:
        return self.proj(F.silu(conv_as_linear(self.patch_embedding, camera_tokens)))


class CausalWanTransformer(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.config = cfg
        dim = cfg.inner_dim
        self.patch_embedding = nn.Conv3d(cfg.in_channels, dim, kernel_size=cfg.patch_size, stride=cfg.patch_size)
        self.camera_embedding = CameraEmbedding(cfg.camera_dim, dim, cfg.patch_size)
        self.condition_embedder = WanTimeTextImageEmbedding(
            dim=dim, time_freq_dim=cfg.freq_dim, time_proj_dim=dim * 6, text_embed_dim=cfg.text_dim
        )
        self.blocks = nn.ModuleList([CausalWanBlock(cfg) for _ in range(cfg.num_layers)])
        self.norm_out = FP32LayerNorm(dim, cfg.eps, elementwise_affine=False)
        self.proj_out = nn.Linear(dim, cfg.out_channels * math.prod(cfg.patch_size))
        self.scale_shift_table = nn.Parameter(torch.randn(1, 2, dim) / dim**0.5)

    def text_caches(self, text_states: torch.Tensor, heads: slice) -> TextCache:
        """Project an encoded prompt [1, text_len, text_dim] to per-layer cross-attention K/V (local heads)."""
        context = self.condition_embedder.text_embedder(text_states)
        pairs = [block.attn2.text_kv(context, heads) for block in self.blocks]
        return TextCache([k for k, _ in pairs], [v for _, v in pairs])

    def _timestep_embedding(self, timesteps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """timesteps [B, F] -> temb [B, F, D], projection [B, F, 6, D]."""
        emb = self.condition_embedder
        b, f = timesteps.shape
        freqs = emb.timesteps_proj(timesteps.flatten()).to(self.proj_out.weight.dtype)
        temb = emb.time_embedder(freqs)
        proj = emb.time_proj(emb.act_fn(temb))
        return temb.reshape(b, f, -1), proj.reshape(b, f, 6, -1)

    def forward(
        self,
        latents: torch.Tensor,
        camera: torch.Tensor,
        timesteps: torch.Tensor,
        tokens_per_frame: int,
        ctx: ForwardContext,
    ) -> torch.Tensor:
        """latents [B, C_in, F, H, W] and camera [B, C_cam, F, H, W] (full block, same on every rank),
        timesteps [B, F] -> prediction [B, C_out, F, H, W] (gathered on every rank)."""
        patch = self.config.patch_size
        b, _, f, h, w = latents.shape
        grid = (f // patch[0], h // patch[1], w // patch[2])
        sp = ctx.sp
        hidden = conv_as_linear(self.patch_embedding, sp.shard(patchify(latents, patch), 1))
        hidden = hidden + self.camera_embedding(sp.shard(patchify(camera, patch), 1))

        temb, proj = self._timestep_embedding(timesteps)
        frame_of_token = sp.shard(torch.arange(math.prod(grid), device=latents.device) // tokens_per_frame, 0)
        modulation = proj[:, frame_of_token]  # [B, L/sp, 6, D]
        for layer, block in enumerate(self.blocks):
            hidden = block(hidden, modulation, ctx, layer)

        shift, scale = (self.scale_shift_table + temb[:, frame_of_token, None].float()).unbind(2)
        hidden = (self.norm_out(hidden.float()) * (1 + scale) + shift).type_as(hidden)
        local_out = self.proj_out(hidden)  # project local tokens, then gather the small output
        return unpatchify(sp.gather_seq(local_out, 1), patch, grid)
