"""The model dtypes a config may name, and what "auto" means on a device."""
from __future__ import annotations

import torch

DTYPE_BY_NAME = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """name: "auto" (float32 on CPU, bfloat16 on an accelerator) or a key of DTYPE_BY_NAME."""
    if name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return DTYPE_BY_NAME[name]


def dtype_name(dtype: torch.dtype) -> str:
    return next(k for k, v in DTYPE_BY_NAME.items() if v == dtype)
