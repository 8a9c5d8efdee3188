"""RMSNorm through the kernel backend (whole on every tensor-parallel rank), optionally with
the residual add before it folded in."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from common.model.layers.weight_slots import Slot, new_param, whole_slot

if TYPE_CHECKING:
    from kernels import Backend


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = new_param(size, dtype=dtype)
        self.eps = eps

    def weight_slots(self, name: str) -> dict[str, Slot]:
        return {name + ".weight": whole_slot(self.weight)}

    def forward(self, x: torch.Tensor, backend: Backend, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The norm of x; with `residual`, the norm of residual + x, the sum left in
        residual (in place: the caller owns it)."""
        if residual is None:
            return backend.rms_norm(x, self.weight, self.eps)
        return backend.add_rms_norm(x, residual, self.weight, self.eps)
