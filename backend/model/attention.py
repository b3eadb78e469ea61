"""Attention kernels: flash-attn on CUDA when installed, torch SDPA otherwise (CPU)."""
from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..api.errors import ConfigError

# q: [B, Lq, H, D], k/v: [B, Lk, H, D] -> [B, Lq, H, D]
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    from flash_attn import flash_attn_func

    return flash_attn_func(q, k, v)


def select_attention(backend: str, device: torch.device, dtype: torch.dtype) -> tuple[str, AttentionFn]:
    """Resolve 'auto' | 'flash' | 'sdpa' to a kernel that can run on `device` with `dtype`."""
    flash_ok = (
        device.type == "cuda"
        and dtype in (torch.float16, torch.bfloat16)
        and importlib.util.find_spec("flash_attn") is not None
    )
    if backend == "flash":
        if not flash_ok:
            raise ConfigError(
                f"attention_backend='flash' needs CUDA, fp16/bf16 and the flash-attn package "
                f"(device={device}, dtype={dtype}); use 'sdpa' or 'auto'"
            )
        return "flash", flash_attention
    if backend == "auto" and flash_ok:
        return "flash", flash_attention
    return "sdpa", sdpa_attention
