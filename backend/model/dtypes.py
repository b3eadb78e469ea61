"""The serving dtypes by config name: the one table the engine settings are checked against."""
from __future__ import annotations

import torch

TORCH_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
