"""msModelSlim's W8A8 (static activations) and W8A8_MIX.

W8A8: activations int8, asymmetric, one scale and offset per tensor calibrated offline;
weights int8 symmetric per output channel; the float bias folded into an int32 one:

    x_q     = clamp(round(x / input_scale + input_offset), -128, 127)
    y[m, n] = (x_q @ W_q^T + quant_bias)[m, n] * deq_scale[n]
    quant_bias = round(b / deq_scale - input_offset * sum_k W_q[n, k]),  deq_scale = s_x * s_w

Checkpoint tensors of each projection: `weight` int8 [out, in], `input_scale` and
`input_offset` [1] (float32; the offset holds an integer), `quant_bias` int32 [out],
`deq_scale` [out] (float32, or for a float16 model the float32 bits in an int64), and
from msModelSlim's older exporter `weight_scale` / `weight_offset` [out, 1] (read, unused).
A `bias` the checkpoint also carries is never added (it is in quant_bias). A fused layer
quantizes its input once, so its parts' input scales and offsets must be equal.
Row-parallel under tensor parallelism: quant_bias is added by rank 0 only.

W8A8_MIX carries both sets (the static one and W8A8_DYNAMIC's weight_scale /
weight_offset); the engine picks its path once (`EngineConfig.w8a8_mix_path`: decode
nodes static, the others dynamic, as vLLM-Ascend's KV consumer and producer do).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from common.model.layers.int8_linear import Int8DynamicLinearMethod, check_zero_offsets, prepare_int8_weight
from common.model.layers.linear import Linear, LinearMethod, WeightSpec

if TYPE_CHECKING:
    from kernels import Backend

log = logging.getLogger("pdmesh.model")
MSMODELSLIM_DIVISOR = 127.0


def float32_bits(tensor: torch.Tensor) -> torch.Tensor:
    """deq_scale as msModelSlim stores it for float16 models: float32 bits, sign-extended
    into int64; float32 as it is otherwise."""
    if tensor.dtype == torch.int64:
        return tensor.to(torch.int32).view(torch.float32)
    return tensor.float()


class Int8StaticLinearMethod(LinearMethod):
    scheme = "W8A8"
    uses_float_bias = False

    def __init__(self):
        self._told: set[int] = set()

    def weight_specs(self, layer: Linear) -> list[WeightSpec]:
        return [WeightSpec("weight", rows="out", cols="in", dtype=torch.int8),
                WeightSpec("input_scale", rows="part", dtype=torch.float32),
                WeightSpec("input_offset", rows="part", dtype=torch.float32),
                WeightSpec("quant_bias", rows="out", dtype=torch.int32),
                WeightSpec("deq_scale", rows="out", dtype=torch.float32, convert=float32_bits),
                WeightSpec("weight_scale", rows="out", cols=1, dtype=torch.float32, optional=True),
                WeightSpec("weight_offset", rows="out", cols=1, dtype=torch.float32, optional=True)]

    def process_after_loading(self, layer: Linear, backend: Backend) -> None:
        for name in ("input_scale", "input_offset"):
            values = getattr(layer, name).data
            if not torch.equal(values, values[:1].expand_as(values)):
                shown = ", ".join(f"{layer.prefix}{p.name}.{name}={float(v)}" for p, v in zip(layer.parts, values))
                raise ValueError(f"fused projections quantize one input, so their {name} must be equal; got {shown}")
        scale, offset = float(layer.input_scale.data[0]), float(layer.input_offset.data[0])
        if not scale > 0 or offset != round(offset):
            raise ValueError(f"{layer.projections[0]}.input_scale must be > 0 and input_offset an integer, "
                             f"got {scale} and {offset}")
        layer.static_input = (scale, offset)
        prepare_int8_weight(layer, backend, self._told, "W8A8 static")
        layer.deq_scale.data = layer.deq_scale.data.reshape(1, -1).contiguous()

    def apply(self, layer: Linear, backend: Backend, x: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        x_q = backend.quantize_per_tensor(rows, *layer.static_input)
        once = layer.group is None or layer.group.rank == 0      # a row-parallel sum gets it once
        out = backend.int8_scaled_matmul(x_q, layer.prepared, layer.deq_scale,
                                         int_bias=layer.quant_bias if once else None, out_dtype=x.dtype)
        return out.view(*x.shape[:-1], out.shape[-1])


class Int8MixLinearMethod(LinearMethod):
    """W8A8_MIX: one checkpoint, both parameter sets; `path` "static" or "dynamic"."""

    scheme = "W8A8_MIX"

    def __init__(self, path: str):
        if path not in ("static", "dynamic"):
            raise ValueError(f"w8a8_mix_path must be 'static' or 'dynamic', got {path!r}")
        self.path = path
        self.static = Int8StaticLinearMethod()
        self.dynamic = Int8DynamicLinearMethod(MSMODELSLIM_DIVISOR)
        self.uses_float_bias = path == "dynamic"

    def weight_specs(self, layer: Linear) -> list[WeightSpec]:
        specs = [s for s in self.static.weight_specs(layer) if s.name not in ("weight_scale", "weight_offset")]
        return specs + [WeightSpec("weight_scale", rows="out", cols=1, dtype=torch.float32),
                        WeightSpec("weight_offset", rows="out", cols=1, dtype=torch.float32)]

    def process_after_loading(self, layer: Linear, backend: Backend) -> None:
        check_zero_offsets(layer)
        if self.path == "static":
            self.static.process_after_loading(layer, backend)
            unused = ("weight_scale",)
        else:
            self.dynamic.process_after_loading(layer, backend)
            unused = ("input_scale", "input_offset", "quant_bias", "deq_scale")
        for name in unused:
            getattr(layer, name).data = getattr(layer, name).data.new_empty(0)

    def apply(self, layer: Linear, backend: Backend, x: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        chosen = self.static if self.path == "static" else self.dynamic
        return chosen.apply(layer, backend, x, bias)
