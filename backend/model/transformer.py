"""LingBot-World v2 causal video DiT: checkpoint-exact names, Ulysses sequence parallelism, caller-owned KV cache.

Parameter names and shapes are those of the published checkpoint (`WanModelFast` in robbyant/lingbot-world-v2).
The math follows the reference under its production setting (bf16 weights, CUDA autocast to bf16 with float32
islands) but without autocast: every op states its dtype.

    compute dtype (the weights' dtype): patch/camera/text embeddings, q/k/v/o, FFN, camera injector
    float32: time embedding + projection, modulation, LayerNorms, residual stream (after the first residual
             add of block 0), output head (its Linear too)
    float64: rotary rotation when the caller gives float64 tables (the reference always rotates in float64)

Sequence parallelism: each rank holds the whole block's inputs, keeps L/sp tokens (hidden, camera tokens and
per-token modulation are sharded identically), exchanges sequence shards for head shards around the attention
cores, projects its tokens to the output and gathers the result.

Tensor parallelism (tp ranks, `tp_degree` at construction; docs/parallelism.md): q/k/v, the FFN's first layer,
the camera injector's first layer and the camera scale/shift layers are column parallel (each rank computes
its 1/tp of the output channels: heads for q/k/v); o, the FFN's second layer and the camera injector's second
layer are row parallel (partial sums, one float32 all-reduce over the TP group, then the replicated bias).
qk-norm normalises over all heads' channels, so its sum of squares is all-reduced. The camera modulation is
applied to each rank's channel slice of the residual stream, which is then all-gathered. Norms, modulation,
embeddings and the head are replicated. The Ulysses exchanges run on each TP slice's own heads.

The camera branch (camera embedding and MLP, each layer's injector MLP and its scale/shift layers) depends on the
block's camera alone, not on the latents or the timestep: it runs once per block (`camera_modulation`), and every
forward of the block (4 DMD steps and the commit) applies the same per-layer (1 + scale, shift). The reference
recomputes it in each forward; the values are the same bits either way.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel.sequence import SequenceParallel
from ..parallel.tensor import TensorParallel
from .attention import AttentionFn
from .config import TransformerConfig
from .kv_cache import LayerKV, SelfAttentionCache, TextCache
from .rope import apply_rotary


@dataclass(frozen=True)
class CameraModulation:
    """Each layer's camera modulation of one block, for this rank's tokens and channels: (1 + scale) and shift
    [B, L/sp, D/tp] in the compute dtype (the reference rounds them to it). Made from `camera`, the block's camera
    features, by `LingBotTransformer.camera_modulation`; its memory: model/memory.camera_modulation_bytes."""

    source: torch.Tensor  # the camera features it was made from (a forward on another tensor makes its own)
    scale: list[torch.Tensor]  # 1 + scale, per layer
    shift: list[torch.Tensor]


@dataclass
class ForwardContext:
    """What the forwards over a batch of sessions' current blocks need besides the tensors; one context serves
    all the forwards of those blocks: it keeps their camera modulation, made at the first forward from the camera
    tensor it is given, and used by every later forward given that same tensor object (which must not change in
    place meanwhile)."""

    sp: SequenceParallel
    attention: AttentionFn
    rope_cos: torch.Tensor  # [B, L/sp, head_dim/2], this rank's tokens (float64 reproduces the reference)
    rope_sin: torch.Tensor
    self_caches: list[SelfAttentionCache]  # one per batch element, this rank's head shard
    text_caches: list[TextCache]  # one per batch element
    tp: TensorParallel = field(default_factory=TensorParallel)
    camera_modulation: CameraModulation | None = None  # the blocks' camera modulation, once made

    def layer(self, index: int) -> LayerContext:
        return LayerContext(
            self.sp, self.attention, self.rope_cos, self.rope_sin,
            self_kv=[c.layer(index) for c in self.self_caches],
            text_kv=[(c.keys[index], c.values[index]) for c in self.text_caches],
            tp=self.tp,
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
    tp: TensorParallel = field(default_factory=TensorParallel)


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


def row_parallel(layer: nn.Linear, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """A Linear whose input features are split over the TP group: the partial products are summed in float32
    (one all-reduce), then the (replicated) bias is added and the result cast to x's dtype."""
    if tp.degree == 1:
        return layer(x)
    total = tp.all_reduce(F.linear(x, layer.weight).float())
    return (total + layer.bias.float()).to(x.dtype)


class RMSNorm(nn.Module):
    """Wan's RMSNorm over the whole projection (all heads): normalise in float32, cast back, then scale.

    Under TP a rank holds `dim / tp` of the channels (and of the weight): the sum of squares is all-reduced."""

    def __init__(self, dim: int, eps: float, tp_degree: int = 1) -> None:
        super().__init__()
        self.eps = eps
        self.dim = dim
        self.weight = nn.Parameter(torch.ones(dim // tp_degree))

    def forward(self, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        xf = x.float()
        if tp.degree == 1:
            mean_square = xf.pow(2).mean(dim=-1, keepdim=True)
        else:
            mean_square = tp.all_reduce(xf.pow(2).sum(dim=-1, keepdim=True)) / self.dim
        return (xf * torch.rsqrt(mean_square + self.eps)).to(x.dtype) * self.weight


# ----------------------------------------------------------------------------------------------------------
# Blocks
# ----------------------------------------------------------------------------------------------------------


class _Projections(nn.Module):
    """q/k/v column parallel by heads (num_heads / tp per rank), o row parallel."""

    def __init__(self, dim: int, num_heads: int, qk_norm: bool, eps: float, tp_degree: int) -> None:
        super().__init__()
        self.num_heads = num_heads // tp_degree  # this rank's heads
        local = dim // tp_degree
        self.q = nn.Linear(dim, local)
        self.k = nn.Linear(dim, local)
        self.v = nn.Linear(dim, local)
        self.o = nn.Linear(local, dim)
        self.norm_q = RMSNorm(dim, eps, tp_degree) if qk_norm else None
        self.norm_k = RMSNorm(dim, eps, tp_degree) if qk_norm else None

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (self.num_heads, -1))

    @staticmethod
    def normed(norm: RMSNorm | None, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        return norm(x, tp) if norm is not None else x

    def out(self, ctx: LayerContext, per_head: torch.Tensor) -> torch.Tensor:
        return row_parallel(self.o, ctx.sp.heads_to_seq(per_head).flatten(-2), ctx.tp)


class CausalSelfAttention(_Projections):
    def forward(self, x: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        """x [B, L/sp, D] (compute dtype) -> [B, L/sp, D]; attends over each session's cached history + block."""
        q = self.heads(self.normed(self.norm_q, self.q(x), ctx.tp))
        k = self.heads(self.normed(self.norm_k, self.k(x), ctx.tp))
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
    def text_kv(self, context: torch.Tensor, heads: slice, tp: TensorParallel) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompt K/V for `heads` (of this rank's TP heads; norm_k spans every head: project, then slice)."""
        k = self.heads(self.normed(self.norm_k, self.k(context), tp))[:, :, heads].contiguous()
        v = self.heads(self.v(context))[:, :, heads].contiguous()
        return k, v

    def forward(self, x: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        q = ctx.sp.seq_to_heads(self.heads(self.normed(self.norm_q, self.q(x), ctx.tp)))
        outs = [ctx.attention(q[i : i + 1], keys, values) for i, (keys, values) in enumerate(ctx.text_kv)]
        return self.out(ctx, torch.cat(outs))


class CausalBlock(nn.Module):
    def __init__(self, cfg: TransformerConfig, tp_degree: int = 1) -> None:
        super().__init__()
        dim = cfg.dim
        local, ffn_local = dim // tp_degree, cfg.ffn_dim // tp_degree
        self.eps = cfg.eps
        self.self_attn = CausalSelfAttention(dim, cfg.num_heads, cfg.qk_norm, cfg.eps, tp_degree)
        self.norm3 = nn.LayerNorm(dim, eps=cfg.eps, elementwise_affine=True) if cfg.cross_attn_norm else None
        self.cross_attn = CrossAttention(dim, cfg.num_heads, cfg.qk_norm, cfg.eps, tp_degree)
        self.ffn = nn.Sequential(nn.Linear(dim, ffn_local), nn.GELU(approximate="tanh"), nn.Linear(ffn_local, dim))
        # div_ in place: on the meta device (every load) `/` runs torch's Python reference, which imports torch._dynamo
        self.modulation = nn.Parameter(torch.randn(1, 6, dim).div_(dim**0.5))
        # Camera MLP: column then row parallel; scale/shift column parallel (each rank's channels of x).
        self.cam_injector_layer1 = nn.Linear(dim, local)
        self.cam_injector_layer2 = nn.Linear(local, dim)
        self.cam_scale_layer = nn.Linear(dim, local)
        self.cam_shift_layer = nn.Linear(dim, local)

    def camera_modulation(self, cam: torch.Tensor, tp: TensorParallel) -> tuple[torch.Tensor, torch.Tensor]:
        """Camera tokens [B, L/sp, D] (compute dtype) -> (1 + scale, shift) for this rank's channels [B, L/sp, D/tp]
        (compute dtype): the injector MLP (column then row parallel) with its residual, then scale and shift."""
        c = row_parallel(self.cam_injector_layer2, F.silu(self.cam_injector_layer1(cam)), tp) + cam
        return 1.0 + self.cam_scale_layer(c), self.cam_shift_layer(c)

    def forward(
        self, x: torch.Tensor, mod: torch.Tensor, cam_scale: torch.Tensor, cam_shift: torch.Tensor, ctx: LayerContext
    ) -> torch.Tensor:
        """x [B, L/sp, D] (compute dtype entering block 0, float32 after), mod [B, L/sp, 6, D] float32,
        cam_scale (1 + scale) and cam_shift [B, L/sp, D/tp] (compute dtype: `camera_modulation`). Returns float32."""
        cd = self.ffn[0].weight.dtype
        shift1, scale1, gate1, shift2, scale2, gate2 = (self.modulation.float() + mod).unbind(2)

        # Self-attention; the reference rounds norm1's output to x's dtype before modulating in float32.
        h = layer_norm_fp32(x, self.eps).to(x.dtype).float() * (1 + scale1) + shift1
        x = x.float() + self.self_attn(h.to(cd), ctx).float() * gate1

        # Camera injection (float32 math on the compute-dtype modulation), on this rank's channels of x, gathered after.
        tp = ctx.tp
        mine = x[..., tp.part(x.shape[-1])]
        x = tp.gather_last(cam_scale.float() * mine + cam_shift.float())

        # Cross-attention (no modulation, no gate).
        h = layer_norm_fp32(x, self.eps, self.norm3) if self.norm3 is not None else x
        x = x + self.cross_attn(h.to(cd), ctx).float()

        # FFN.
        h = layer_norm_fp32(x, self.eps) * (1 + scale2) + shift2
        up, act, down = self.ffn
        return x + row_parallel(down, act(up(h.to(cd))), tp).float() * gate2


class Head(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.eps = cfg.eps
        self.head = nn.Linear(cfg.dim, cfg.out_dim * math.prod(cfg.patch_size))
        self.modulation = nn.Parameter(torch.randn(1, 2, cfg.dim).div_(cfg.dim**0.5))  # div_: see CausalBlock's

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        """x [B, L/sp, D], temb [B, L/sp, D] float32 (time embedding before the 6-way projection). Float32."""
        shift, scale = (self.modulation.float() + temb.float()[:, :, None]).unbind(2)
        return linear_fp32(self.head, layer_norm_fp32(x, self.eps) * (1 + scale) + shift)


class LingBotTransformer(nn.Module):
    def __init__(self, cfg: TransformerConfig, tp_degree: int = 1) -> None:
        """tp_degree > 1: this rank's slices only (heads, channels and features of the split layers / tp)."""
        super().__init__()
        self.config = cfg
        self.tp_degree = tp_degree
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
        self.blocks = nn.ModuleList([CausalBlock(cfg, tp_degree) for _ in range(cfg.num_layers)])
        self.head = Head(cfg)

    def compile_blocks(self) -> None:
        """torch.compile each block, compiled on first use (a LayerContext makes one graph serve every layer);
        cache lengths vary, so shapes are dynamic."""
        for block in self.blocks:
            block.compile(dynamic=True)

    def weight_bytes(self) -> int:
        """Bytes of the parameters this rank holds."""
        return sum(t.numel() * t.element_size() for t in self.state_dict().values())

    # -- prompt --------------------------------------------------------------------------------------------

    def text_caches(self, text_states: torch.Tensor, heads: slice, tp: TensorParallel | None = None) -> TextCache:
        """Encoded prompt [1, n <= text_len, text_dim] -> per-layer cross K/V for `heads` (of this rank's TP heads).

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
        pairs = [block.cross_attn.text_kv(context, heads, tp or TensorParallel()) for block in self.blocks]
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

    def camera_modulation(self, camera: torch.Tensor, sp: SequenceParallel, tp: TensorParallel) -> CameraModulation:
        """Camera features [B, 384, F, H, W] -> every layer's (1 + scale, shift) for this rank's tokens (a TP
        collective per layer: every rank of the group calls it alike)."""
        tokens = self.camera_tokens(sp.shard(patchify(camera, self.config.patch_size), 1))
        scale, shift = zip(*(block.camera_modulation(tokens, tp) for block in self.blocks))
        return CameraModulation(source=camera, scale=list(scale), shift=list(shift))

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
        if ctx.camera_modulation is None or ctx.camera_modulation.source is not camera:  # the block's first forward
            ctx.camera_modulation = self.camera_modulation(camera, sp, ctx.tp)
        cam = ctx.camera_modulation

        temb, proj = self.time_embeddings(timesteps)
        frame_of_token = sp.shard(torch.arange(tokens, device=latents.device) // tokens_per_frame, 0)
        mod = proj[:, frame_of_token]  # [B, L/sp, 6, D]
        for layer, block in enumerate(self.blocks):
            x = block(x, mod, cam.scale[layer], cam.shift[layer], ctx.layer(layer))

        local_out = self.head(x, temb[:, frame_of_token])
        return unpatchify(sp.gather_seq(local_out, 1), patch, grid).float()
