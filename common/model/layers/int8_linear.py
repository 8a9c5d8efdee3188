"""W8A8 with dynamic activations: weights int8 per output channel (symmetric), activations
int8 per token, quantized at run time; the int8 GEMM accumulates exactly in int32.

    s_x[m] = max_k |x[m, k]| / divisor            (per token, backend.quantize_per_token)
    x_q    = clamp(round(x / s_x), -128, 127)
    y[m,n] = (x_q @ W_q^T)[m, n] * s_x[m] * s_w[n] + b[n]

Checkpoint tensors of each projection: `weight` int8 [out, in], `weight_scale` [out, 1]
(any float dtype; kept in float32), and with msModelSlim `weight_offset` [out, 1], which
must be zeros (symmetric weights). `divisor` is the producer's convention: 127.5 for
compressed-tensors (its symmetric range (127 - (-128)) / 2), 127 for msModelSlim
(npu_dynamic_quant's).

Under tensor parallelism a row-parallel layer quantizes its own columns of each token,
so its scales are the rank's, as in vLLM: the result differs from tensor_parallel_size 1
by the rounding of those scales.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from common.model.layers.linear import Linear, LinearMethod, WeightSpec

if TYPE_CHECKING:
    from kernels import Backend

log = logging.getLogger("pdmesh.model")


class Int8DynamicLinearMethod(LinearMethod):
    scheme = "W8A8_DYNAMIC"

    def __init__(self, divisor: float, weight_offset: bool = False):
        self.divisor = divisor
        self.weight_offset = weight_offset
        self._told: set[int] = set()    # backends whose int8 path was logged

    def weight_specs(self, layer: Linear) -> list[WeightSpec]:
        specs = [WeightSpec("weight", rows="out", cols="in", dtype=torch.int8),
                 WeightSpec("weight_scale", rows="out", cols=1, dtype=torch.float32)]
        if self.weight_offset:
            specs.append(WeightSpec("weight_offset", rows="out", cols=1, dtype=torch.float32))
        return specs

    def process_after_loading(self, layer: Linear, backend: Backend) -> None:
        if self.weight_offset:
            check_zero_offsets(layer)
        prepare_int8_weight(layer, backend, self._told, "W8A8 dynamic")
        layer.weight_scale.data = layer.weight_scale.data.reshape(1, -1).contiguous()   # [1, out]

    def apply(self, layer: Linear, backend: Backend, x: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        x_q, x_scale = backend.quantize_per_token(rows, self.divisor)
        out = backend.int8_scaled_matmul(x_q, layer.prepared, layer.weight_scale, row_scale=x_scale, bias=bias,
                                         out_dtype=x.dtype)
        return out.view(*x.shape[:-1], out.shape[-1])


def check_zero_offsets(layer: Linear) -> None:
    """ValueError naming the projection unless its weight_offset is all zeros."""
    rows = 0
    for part in layer.parts:
        if layer.weight_offset.data[rows:rows + part.out].abs().max() != 0:
            raise ValueError(f"{layer.prefix}{part.name}.weight_offset is not all zeros: asymmetric int8 weights are not "
                             f"supported; supported: symmetric (weight_offset 0)")
        rows += part.out
    layer.weight_offset.data = layer.weight_offset.data.new_empty(0)


def prepare_int8_weight(layer: Linear, backend: Backend, told: set[int], label: str) -> None:
    """layer.prepared = the backend's form of the int8 weight (the dense storage released
    when it made another); the backend's int8 path logged once per backend and method."""
    if id(backend) not in told:
        told.add(id(backend))
        log.info("%s linear layers: %s", label, backend.int8_path)
    dense = layer.weight.data
    layer.prepared = backend.prepare_int8_weight(dense)
    if layer.prepared is not dense:
        layer.weight.data = dense.new_empty(0)
