"""The dense gated MLP: down(silu(gate(x)) * up(x)); gate and up fused into one
column-parallel matmul (this rank's intermediate columns), down row-parallel."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from common.model.layers.linear import Linear, LinearPart
from common.model.layers.quant_config import QuantizationConfig
from common.model.layers.weight_slots import Slot
from common.parallel.shard import TPShard

if TYPE_CHECKING:
    from kernels import Backend


class GatedMLP(nn.Module):
    """prefix: the checkpoint's name of this module, e.g. "model.layers.3.mlp."."""

    def __init__(self, hidden_size: int, intermediate_size: int, shard: TPShard,
                 quant: QuantizationConfig, prefix: str, dtype: torch.dtype, bias: bool = False):
        super().__init__()
        inter = intermediate_size // shard.size
        i0 = shard.rank * inter
        parts = [LinearPart("gate_proj", intermediate_size, inter, i0),
                 LinearPart("up_proj", intermediate_size, inter, i0)]
        self.gate_up = Linear(parts, hidden_size, quant.linear_method([prefix + p.name for p in parts]),
                              dtype, bias=bias, prefix=prefix)
        self.down = Linear([LinearPart("down_proj", hidden_size, hidden_size)], intermediate_size,
                           quant.linear_method([prefix + "down_proj"]), dtype, bias=bias,
                           row_parallel=True, in_features=inter, in_start=i0, prefix=prefix)

    def weight_slots(self, prefix: str) -> dict[str, Slot]:
        return {**self.gate_up.weight_slots(prefix), **self.down.weight_slots(prefix)}

    def forward(self, x: torch.Tensor, backend: Backend) -> torch.Tensor:
        return self.down(backend.silu_and_mul(self.gate_up(x, backend)), backend)
