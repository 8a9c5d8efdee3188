"""The float scheme: weight [out, in] in the model's dtype, multiplied by the kernel
backend's `linear` on whatever its `prepare_linear` made of it (a oneDNN-packed copy on
CPU; the dense weight elsewhere). Where the backend made another object, the dense
storage is released: no second copy of the weights is kept."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from common.model.layers.linear import Linear, LinearMethod, WeightSpec

if TYPE_CHECKING:
    from kernels import Backend


class FloatLinearMethod(LinearMethod):
    scheme = "FLOAT"

    def weight_specs(self, layer: Linear) -> list[WeightSpec]:
        return [WeightSpec("weight", rows="out", cols="in")]

    def process_after_loading(self, layer: Linear, backend: Backend) -> None:
        dense = layer.weight.data      # one tensor object: .data makes a new one at each access
        layer.prepared = backend.prepare_linear(dense)
        if layer.prepared is not dense:
            layer.weight.data = dense.new_empty(0)

    def apply(self, layer: Linear, backend: Backend, x: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        return backend.linear(x, layer.prepared, bias)
