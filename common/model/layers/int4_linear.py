"""W4A16: weights 4-bit per group of inputs (symmetric), activations in the model's dtype.

    w[n, k] = q[n, k] * s[n, k // group]        q in [-8, 7]

Checkpoint tensors of each projection (compressed-tensors' `pack-quantized`):
`weight_packed` int32 [out, in / 8], code j of a row at bits 4 * (j % 8) of word j // 8,
stored as q + 8; `weight_scale` [out, in / group] (any float dtype; kept in float32);
`weight_shape` [2] = (out, in), checked against the config at load.

The kernel backend takes the unpacked codes once after loading (prepare_int4_weight):
torch's packed int4 matmul on CPU, the dequantized weight elsewhere.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from common.model.layers.linear import Linear, LinearMethod, WeightSpec

if TYPE_CHECKING:
    from kernels import Backend

log = logging.getLogger("pdmesh.model")
PACK = 8          # 4-bit codes per int32


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int32 [rows, cols / 8] -> int32 [rows, cols] of the stored codes (q + 8, 0..15)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & 0xF).reshape(packed.shape[0], -1)


class Int4GroupLinearMethod(LinearMethod):
    scheme = "W4A16"

    def __init__(self, group_size: int):
        self.group_size = group_size
        self._told: set[int] = set()

    def weight_specs(self, layer: Linear) -> list[WeightSpec]:
        g = self.group_size
        if g % PACK or layer.full_in % g or layer.in_features % g or layer.in_start % g:
            raise ValueError(f"group_size {g} must be a multiple of {PACK} (codes per int32) dividing the input "
                             f"features ({layer.full_in}) and every tensor-parallel rank's share of them "
                             f"({layer.in_features})")
        return [WeightSpec("weight_packed", rows="out", cols="in", dtype=torch.int32, in_pack=PACK),
                WeightSpec("weight_scale", rows="out", cols="in", dtype=torch.float32, in_pack=g),
                WeightSpec("weight_shape", rows="part", cols=2, dtype=torch.int64)]

    def process_after_loading(self, layer: Linear, backend: Backend) -> None:
        for i, part in enumerate(layer.parts):
            shape = tuple(int(v) for v in layer.weight_shape[i])
            if shape != (part.full_out, layer.full_in):
                raise ValueError(f"{layer.prefix}{part.name}.weight_shape is {shape}, expected {(part.full_out, layer.full_in)} "
                                 f"from config.json")
        if id(backend) not in self._told:
            self._told.add(id(backend))
            log.info("W4A16 linear layers: %s", backend.int4_path)
        codes = unpack_int4(layer.weight_packed.data)
        layer.prepared = backend.prepare_int4_weight(codes, layer.weight_scale.data, self.group_size, layer.dtype)
        layer.weight_packed.data = layer.weight_packed.data.new_empty(0)
        layer.weight_scale.data = layer.weight_scale.data.new_empty(0)

    def apply(self, layer: Linear, backend: Backend, x: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        return backend.int4_linear(x, layer.prepared, bias)
