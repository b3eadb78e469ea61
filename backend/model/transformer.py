"""LingBot-World v2 causal video DiT: checkpoint-exact names, Ulysses sequence parallelism, caller-owned KV cache.

Parameter names and shapes are those of the published checkpoint (`WanModelFast` in robbyant/lingbot-world-v2).
The math follows the reference under its production setting (bf16 weights, CUDA autocast to bf16 with float32
islands) but without autocast: every op states its dtype.

    compute dtype (the weights' dtype): patch/camera/text embeddings, q/k/v/o, FFN, camera injector
    float32: time embedding + projection, modulation, LayerNorms, residual stream (after the first residual
             add of block 0), output head (its Linear too)
    float64: rotary rotation when the caller gives float64 tables (the reference always rotates in float64)

Sequence parallelism: each rank holds every weight and the whole block's inputs, keeps L/sp tokens
(hidden, camera tokens and per-token modulation are sharded identically), exchanges sequence shards for head
shards around the attention cores, projects its tokens to the output and gathers the result.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel.sequence import SequenceParallel
from .attention import AttentionFn
from .config import TransformerConfig
from .kv_cache import LayerKV, SelfAttentionCache, TextCache
from .rope import apply_rotary


@dataclass
class ForwardContext:
    """What one forward over a batch of sessions' current blocks needs besides the tensors."""

    sp: SequenceParallel
    attention: AttentionFn
    rope_cos: torch.Tensor  # [B, L/sp, head_dim/2], this rank's tokens (float64 reproduces the reference)
    rope_sin: torch.Tensor
    self_caches: list[SelfAttentionCache]  # one per batch element, this rank's head shard
    text_caches: list[TextCache]  # one per batch element

    def layer(self, index: int) -> LayerContext:
        return LayerContext(
            self.sp, self.attention, self.rope_cos, self.rope_sin,
            self_kv=[c.layer(index) for c in self.self_caches],
            text_kv=[(c.keys[index], c.values[index]) for c in self.text_caches],
        )


@dataclass
class LayerContext:
    """ForwardContext narrowed to one layer's caches: a compiled block is then one graph for every layer
    (indexing the caches by layer inside it would specialise a graph per layer)."""

    sp: SequenceParallel
    attention: AttentionFn
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor
    self_kv: list[LayerKV]  # one per batch element
    text_kv: list[tuple[torch.Tensor, torch.Tensor]]  # prompt keys, values per batch element


def patchify(x: torch.Tensor, patch: tuple[int, int, int]) -> torch.Tensor:
    """[B, C, F, H, W] -> [B, L, C*pt*ph*pw]; tokens (f, h, w)-major, features (c, pt, ph, pw).

    This is both the Conv3d(kernel=stride) weight order and the reference's camera rearrange
    '1 c (f c1) (h c2) (w c3) -> 1 (f h w) (c c1 c2 c3)'.
    """
    b, c, f, h, w = x.shape
    pt, ph, pw = patch
    x = x.reshape(b, c, f // pt, pt, h // ph, ph, w // pw, pw)
    return x.permute(0, 2, 4, 6, 1, 3, 5, 7).reshape(b, (f // pt) * (h // ph) * (w // pw), c * pt * ph * pw)


def unpatchify(tokens: torch.Tensor, patch: tuple[int, int, int], grid: tuple[int, int, int]) -> torch.Tensor:
    """[B, L, pt*ph*pw*C] (head layout: features (pt, ph, pw, c)) -> [B, C, F, H, W]."""
    b = tokens.shape[0]
    pt, ph, pw = patch
    f, h, w = grid
    x = tokens.reshape(b, f, h, w, pt, ph, pw, -1)
    return x.permute(0, 7, 1, 4, 2, 5, 3, 6).reshape(b, -1, f * pt, h * ph, w * pw)


def sinusoidal_embedding(freq_dim: int, t: torch.Tensor) -> torch.Tensor:
    """Wan's timestep embedding: [cos | sin] of t * 10000^(-i/half), float64 -> float32."""
    half = freq_dim // 2
    t = t.to(torch.float64)
    args = torch.outer(t, torch.pow(10000.0, -torch.arange(half, dtype=torch.float64, device=t.device) / half))
    return torch.cat([args.cos(), args.sin()], dim=1).float()


def linear_fp32(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A Linear evaluated in float32 whatever the weights' dtype (the reference's float32 autocast islands)."""
    bias = layer.bias.float() if layer.bias is not None else None
    return F.linear(x.float(), layer.weight.float(), bias)


def layer_norm_fp32(x: torch.Tensor, eps: float, norm: nn.LayerNorm | None = None) -> torch.Tensor:
    """LayerNorm computed in float32 (affine parameters too) with a float32 result."""
    weight = norm.weight.float() if norm is not None else None
    bias = norm.bias.float() if norm is not None else None
    return F.layer_norm(x.float(), (x.shape[-1],), weight, bias, eps)


class RMSNorm(nn.Module):
    """Wan's RMSNorm over the whole projection (all heads): normalise in float32, cast back, then scale."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight


# ----------------------------------------------------------------------------------------------------------
# Blocks
# ----------------------------------------------------------------------------------------------------------


class _Projections(nn.Module):
    def __init__(self, dim: int, num_heads: int, qk_norm: bool, eps: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)
        self.norm_q = RMSNorm(dim, eps) if qk_norm else nn.Identity()
        self.norm_k = RMSNorm(dim, eps) if qk_norm else nn.Identity()

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (self.num_heads, -1))

    def out(self, ctx: LayerContext, per_head: torch.Tensor) -> torch.Tensor:
        return self.o(ctx.sp.heads_to_seq(per_head).flatten(-2))


class CausalSelfAttention(_Projections):
    def forward(self, x: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        """x [B, L/sp, D] (compute dtype) -> [B, L/sp, D]; attends over each session's cached history + block."""
        q = self.heads(self.norm_q(self.q(x)))
        k = self.heads(self.norm_k(self.k(x)))
        v = self.heads(self.v(x))
        q = apply_rotary(q, ctx.rope_cos, ctx.rope_sin)
        k = apply_rotary(k, ctx.rope_cos, ctx.rope_sin)
        q, k, v = ctx.sp.seq_to_heads(torch.stack([q, k, v])).unbind(0)  # one exchange for all three
        outs = []
        for i, cache in enumerate(ctx.self_kv):
            keys, values = cache.attend_over(k[i : i + 1], v[i : i + 1])
            outs.append(ctx.attention(q[i : i + 1], keys, values))
        return self.out(ctx, torch.cat(outs))


class CrossAttention(_Projections):
    def text_kv(self, context: torch.Tensor, heads: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompt K/V for the heads in `heads` (norm_k spans every head: project fully, then slice)."""
        k = self.heads(self.norm_k(self.k(context)))[:, :, heads].contiguous()
        v = self.heads(self.v(context))[:, :, heads].contiguous()
        return k, v

    def forward(self, x: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        q = ctx.sp.seq_to_heads(self.heads(self.norm_q(self.q(x))))
        outs = [ctx.attention(q[i : i + 1], keys, values) for i, (keys, values) in enumerate(ctx.text_kv)]
        return self.out(ctx, torch.cat(outs))


class CausalBlock(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        dim = cfg.dim
        self.eps = cfg.eps
        self.self_attn = CausalSelfAttention(dim, cfg.num_heads, cfg.qk_norm, cfg.eps)
        self.norm3 = nn.LayerNorm(dim, eps=cfg.eps, elementwise_affine=True) if cfg.cross_attn_norm else None
        self.cross_attn = CrossAttention(dim, cfg.num_heads, cfg.qk_norm, cfg.eps)
        self.ffn = nn.Sequential(nn.Linear(dim, cfg.ffn_dim), nn.GELU(approximate="tanh"), nn.Linear(cfg.ffn_dim, dim))
        self.modulation = nn.Parameter(torch.randn(1, 6, dim) / dim**0.5)
        self.cam_injector_layer1 = nn.Linear(dim, dim)
        self.cam_injector_layer2 = nn.Linear(dim, dim)
        self.cam_scale_layer = nn.Linear(dim, dim)
        self.cam_shift_layer = nn.Linear(dim, dim)

    def forward(
        self, x: torch.Tensor, mod: torch.Tensor, cam: torch.Tensor, ctx: LayerContext
    ) -> torch.Tensor:
        """x [B, L/sp, D] (compute dtype entering block 0, float32 after), mod [B, L/sp, 6, D] float32,
        cam [B, L/sp, D] camera tokens (compute dtype). Returns float32."""
        cd = self.ffn[0].weight.dtype
        shift1, scale1, gate1, shift2, scale2, gate2 = (self.modulation.float() + mod).unbind(2)

        # Self-attention; the reference rounds norm1's output to x's dtype before modulating in float32.
        h = layer_norm_fp32(x, self.eps).to(x.dtype).float() * (1 + scale1) + shift1
        x = x.float() + self.self_attn(h.to(cd), ctx).float() * gate1

        # Camera injection (compute dtype for the MLP; 1 + scale is rounded to that dtype, then float32 math).
        c = self.cam_injector_layer2(F.silu(self.cam_injector_layer1(cam))) + cam
        x = (1.0 + self.cam_scale_layer(c)).float() * x + self.cam_shift_layer(c).float()

        # Cross-attention (no modulation, no gate).
        h = layer_norm_fp32(x, self.eps, self.norm3) if self.norm3 is not None else x
        x = x + self.cross_attn(h.to(cd), ctx).float()

        # FFN.
        h = layer_norm_fp32(x, self.eps) * (1 + scale2) + shift2
        return x + self.ffn(h.to(cd)).float() * gate2


class Head(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.eps = cfg.eps
        self.head = nn.Linear(cfg.dim, cfg.out_dim * math.prod(cfg.patch_size))
        self.modulation = nn.Parameter(torch.randn(1, 2, cfg.dim) / cfg.dim**0.5)

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        """x [B, L/sp, D], temb [B, L/sp, D] float32 (time embedding before the 6-way projection). Float32."""
        shift, scale = (self.modulation.float() + temb.float()[:, :, None]).unbind(2)
        return linear_fp32(self.head, layer_norm_fp32(x, self.eps) * (1 + scale) + shift)


class LingBotTransformer(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.config = cfg
        dim = cfg.dim
        self.patch_embedding = nn.Conv3d(cfg.in_dim, dim, kernel_size=cfg.patch_size, stride=cfg.patch_size)
        self.patch_embedding_wancamctrl = nn.Linear(cfg.camera_dim, dim)
        self.c2ws_hidden_states_layer1 = nn.Linear(dim, dim)
        self.c2ws_hidden_states_layer2 = nn.Linear(dim, dim)
        self.text_embedding = nn.Sequential(
            nn.Linear(cfg.text_dim, dim), nn.GELU(approximate="tanh"), nn.Linear(dim, dim)
        )
        self.time_embedding = nn.Sequential(nn.Linear(cfg.freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(dim, dim * 6))
        self.blocks = nn.ModuleList([CausalBlock(cfg) for _ in range(cfg.num_layers)])
        self.head = Head(cfg)

    # -- prompt --------------------------------------------------------------------------------------------

    def text_caches(self, text_states: torch.Tensor, heads: slice) -> TextCache:
        """Encoded prompt [1, n <= text_len, text_dim] -> per-layer cross K/V for `heads`.

        The reference trims the umT5 output to the prompt's real tokens and zero-pads it to text_len before
        text_embedding; cross-attention then attends over all text_len rows (no mask). Pass the trimmed
        states (or already zero-padded ones): shorter inputs are zero-padded here.
        """
        cfg = self.config
        n = text_states.shape[1]
        if n > cfg.text_len:
            raise ValueError(f"text states have {n} rows, more than text_len {cfg.text_len}")
        cd = self.text_embedding[0].weight.dtype
        states = F.pad(text_states.to(cd), (0, 0, 0, cfg.text_len - n))
        context = self.text_embedding(states)
        pairs = [block.cross_attn.text_kv(context, heads) for block in self.blocks]
        return TextCache([k for k, _ in pairs], [v for _, v in pairs])

    # -- embeddings ----------------------------------------------------------------------------------------

    def time_embeddings(self, timesteps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """timesteps [B, F] -> temb [B, F, D], projection [B, F, 6, D], both float32."""
        b, f = timesteps.shape
        freq = sinusoidal_embedding(self.config.freq_dim, timesteps.flatten())
        t0, _, t2 = self.time_embedding
        temb = linear_fp32(t2, F.silu(linear_fp32(t0, freq)))
        proj = linear_fp32(self.time_projection[1], F.silu(temb))
        return temb.reshape(b, f, -1), proj.reshape(b, f, 6, -1)

    def camera_tokens(self, camera_tokens: torch.Tensor) -> torch.Tensor:
        """Patchified camera features [B, L', camera_dim] -> c = e + MLP(e) [B, L', D] (compute dtype)."""
        cd = self.patch_embedding_wancamctrl.weight.dtype
        e = self.patch_embedding_wancamctrl(camera_tokens.to(cd))
        return e + self.c2ws_hidden_states_layer2(F.silu(self.c2ws_hidden_states_layer1(e)))

    # -- forward -------------------------------------------------------------------------------------------

    def forward(
        self,
        latents: torch.Tensor,
        camera: torch.Tensor,
        timesteps: torch.Tensor,
        tokens_per_frame: int,
        ctx: ForwardContext,
    ) -> torch.Tensor:
        """latents [B, in_dim, F, H, W] (noisy latent ++ 4 mask ++ 16 image-condition channels), camera
        [B, 384, F, H, W], timesteps [B, F] (same on every rank, full block) -> [B, out_dim, F, H, W] float32,
        gathered on every rank."""
        cfg = self.config
        patch = cfg.patch_size
        sp = ctx.sp
        b, _, f, h, w = latents.shape
        grid = (f // patch[0], h // patch[1], w // patch[2])
        tokens = math.prod(grid)
        if grid[1] * grid[2] != tokens_per_frame:
            raise ValueError(f"tokens_per_frame {tokens_per_frame} != {grid[1]}x{grid[2]} for latents {latents.shape}")
        if tokens % sp.degree:
            raise ValueError(f"{tokens} tokens per block are not divisible by the SP degree {sp.degree}")
        if camera.shape[1] != cfg.camera_channels or camera.shape[2:] != latents.shape[2:]:
            raise ValueError(f"camera {tuple(camera.shape)} does not match latents {tuple(latents.shape)}")
        if timesteps.shape != (b, grid[0]):
            raise ValueError(f"timesteps {tuple(timesteps.shape)} != ({b}, {grid[0]})")

        cd = self.patch_embedding.weight.dtype
        conv = self.patch_embedding
        x = F.linear(sp.shard(patchify(latents.to(cd), patch), 1), conv.weight.flatten(1), conv.bias)
        cam = self.camera_tokens(sp.shard(patchify(camera, patch), 1))

        temb, proj = self.time_embeddings(timesteps)
        frame_of_token = sp.shard(torch.arange(tokens, device=latents.device) // tokens_per_frame, 0)
        mod = proj[:, frame_of_token]  # [B, L/sp, 6, D]
        for layer, block in enumerate(self.blocks):
            x = block(x, mod, cam, ctx.layer(layer))

        local_out = self.head(x, temb[:, frame_of_token])
        return unpatchify(sp.gather_seq(local_out, 1), patch, grid).float()
