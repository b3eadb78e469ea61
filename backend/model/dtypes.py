"""The serving dtypes by config name: the one list the engine settings are checked against (torch-free, for the
launcher's start-up check), and the torch dtype each names."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DTYPES = ("float32", "bfloat16", "float16")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of one of DTYPES."""
    import torch

    if name not in DTYPES:
        raise KeyError(name)
    return getattr(torch, name)
