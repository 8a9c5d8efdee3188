"""A linear layer and the quantization seam: its weights and its matmul come from a
`LinearMethod` that the checkpoint's quantization config picks (layers/quant_config.py).

A `Linear` is one matmul of a decoder layer. It may fuse several checkpoint projections
(q/k/v -> qkv, gate/up -> gate_up: its `parts`, stacked along the output features) and
is column-parallel (each rank holds its rows of every part) or row-parallel (each rank
holds its columns of the inputs; the partial sums are all-reduced, the bias added once
after). Its life:

    method.weight_specs(layer)     the parameters it needs, made by Linear.__init__, each
                                   with what its rows and columns follow (WeightSpec)
    weight_slots(prefix)           checkpoint tensor `<prefix><part>.<param>` -> its rows
                                   of the fused parameter, this rank's part of the tensor;
                                   scales shard with their weights by the same rule
    method.process_after_loading   once, on the device: pack, transpose, fold
    forward(x, backend)            method.apply (+ the all-reduce of a row-parallel layer)

The model file names the parts and the parallel kind; it never sees the scheme.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Literal

import torch
from torch import nn

from common.model.layers.weight_slots import Slot, new_param

if TYPE_CHECKING:
    from common.parallel.group import TPGroup
    from kernels import Backend


@dataclass(frozen=True)
class LinearPart:
    """One checkpoint projection of a Linear: its tensor prefix under the layer (e.g.
    "self_attn.k_proj"), its output features in the checkpoint, and this rank's rows of
    them: [out_start, out_start + out)."""

    name: str
    full_out: int
    out: int
    out_start: int = 0


@dataclass(frozen=True)
class WeightSpec:
    """One parameter a linear method needs.

    rows: "out"  one row per output feature (split with the outputs, parts stacked)
          "part" one row per fused part (a per-tensor scale of each projection: the
                 checkpoint tensor is [1], or [cols] when cols is an int)
    cols: None   a 1-D parameter
          "in"   one column per `in_pack` input features (split with the inputs of a
                 row-parallel layer; in_pack 8 for eight int4 codes in an int32)
          int    that many columns, never split
    dtype: None = the model's dtype. convert: the checkpoint tensor -> what is copied in
    (e.g. float32 bits stored in an int64). optional: absent from some producers' files."""

    name: str
    rows: Literal["out", "part"]
    cols: Literal["in"] | int | None = None
    dtype: torch.dtype | None = None
    in_pack: int = 1
    convert: Callable[[torch.Tensor], torch.Tensor] | None = None
    optional: bool = False


class LinearMethod(ABC):
    """How one scheme stores and multiplies a linear layer's weights (vLLM's
    LinearMethodBase). One instance may serve many layers: state lives on the layer."""

    scheme: str = ""    # the quantization type it implements, e.g. "FLOAT"
    uses_float_bias = True   # False: the float bias is folded into the method's own tensors

    @abstractmethod
    def weight_specs(self, layer: Linear) -> list[WeightSpec]:
        """The parameters of `layer` (besides its float bias, which the Linear owns)."""

    def process_after_loading(self, layer: Linear, backend: Backend) -> None:
        """After every tensor was loaded and the layer moved to its device; once."""

    @abstractmethod
    def apply(self, layer: Linear, backend: Backend, x: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        """x [tokens, in_features] -> [tokens, out_features], plus bias when given."""


class Linear(nn.Module):
    """parts: the fused projections, in output order. full_in: input features in the
    checkpoint; a row-parallel layer holds columns [in_start, in_start + in_features).
    bias: a float bias per output feature (`<part>.bias`), added after the all-reduce
    when the layer is row-parallel. prefix: the checkpoint name of the module that holds
    the parts (e.g. "model.layers.0.self_attn.")."""

    def __init__(self, parts: list[LinearPart], full_in: int, method: LinearMethod,
                 dtype: torch.dtype, bias: bool = False, row_parallel: bool = False,
                 in_features: int | None = None, in_start: int = 0, prefix: str = ""):
        super().__init__()
        self.prefix = prefix        # the checkpoint's name of the module holding the parts
        if row_parallel and (len(parts) != 1 or parts[0].out != parts[0].full_out):
            raise ValueError("a row-parallel Linear has one part with all of its outputs")
        self.parts = parts
        self.full_in = full_in
        self.in_features = full_in if in_features is None else in_features
        self.in_start = in_start
        self.out_features = sum(p.out for p in parts)
        self.row_parallel = row_parallel
        self.dtype = dtype          # the model's: what activations and float weights are in
        self.method = method
        self.specs = method.weight_specs(self)
        for spec in self.specs:
            self.register_parameter(spec.name, new_param(*self._shape(spec), dtype=spec.dtype or dtype))
        self.bias = new_param(self.out_features, dtype=dtype) if bias else None
        self.prepared: Any = None           # what the method's apply multiplies by (its own use)
        self.group: TPGroup | None = None   # a row-parallel layer's, at tensor_parallel_size > 1

    @property
    def projections(self) -> list[str]:
        """The checkpoint names of the parts, e.g. "model.layers.0.self_attn.q_proj"."""
        return [self.prefix + part.name for part in self.parts]

    def _shape(self, spec: WeightSpec) -> tuple[int, ...]:
        rows = self.out_features if spec.rows == "out" else len(self.parts)
        if spec.cols is None:
            return (rows,)
        if spec.cols == "in":
            return (rows, self.in_features // spec.in_pack)
        return (rows, spec.cols)

    def attach_group(self, group: TPGroup) -> None:
        if self.row_parallel:
            self.group = group

    def weight_slots(self, prefix: str) -> dict[str, Slot]:
        """Checkpoint tensor name -> Slot, for every parameter of every part."""
        slots: dict[str, Slot] = {}
        specs = list(self.specs)
        if self.bias is not None:    # a method that folds the bias in need not find it in the file
            specs.append(WeightSpec("bias", rows="out", optional=not self.method.uses_float_bias))
        row = 0
        for i, part in enumerate(self.parts):
            for spec in specs:
                param = getattr(self, spec.name)
                if spec.rows == "out" and not (spec.name == "bias" and self.row_parallel):
                    start, end, full_rows, src_row = row, row + part.out, part.full_out, part.out_start
                elif spec.rows == "out":     # a row-parallel bias: whole on every rank
                    start, end, full_rows, src_row = 0, self.out_features, self.out_features, 0
                else:
                    full = (spec.cols,) if isinstance(spec.cols, int) else (1,)
                    slots[f"{prefix}{part.name}.{spec.name}"] = Slot(param, i, i + 1, full, None, spec.convert,
                                                                     spec.optional)
                    continue
                slots[f"{prefix}{part.name}.{spec.name}"] = self._slot(param, spec, start, end, full_rows, src_row)
            row += part.out
        return slots

    def _slot(self, param: nn.Parameter, spec: WeightSpec, start: int, end: int, full_rows: int,
              src_row: int) -> Slot:
        rows_whole = src_row == 0 and end - start == full_rows
        source: list[slice] = [slice(None) if rows_whole else slice(src_row, src_row + end - start)]
        full: tuple[int, ...] = (full_rows,)
        cols_whole = True
        if spec.cols == "in":
            pack = spec.in_pack
            full += (self.full_in // pack,)
            cols_whole = self.in_features == self.full_in
            source.append(slice(self.in_start // pack, (self.in_start + self.in_features) // pack))
        elif spec.cols is not None:
            full += (spec.cols,)
        return Slot(param, start, end, full, None if rows_whole and cols_whole else tuple(source), spec.convert,
                    spec.optional)

    def prepare(self, backend: Backend) -> None:
        self.method.process_after_loading(self, backend)

    def forward(self, x: torch.Tensor, backend: Backend) -> torch.Tensor:
        bias = self.bias if self.method.uses_float_bias else None
        if self.group is None:
            return self.method.apply(self, backend, x, bias)
        out = self.group.all_reduce(self.method.apply(self, backend, x, None).contiguous())
        return out if bias is None else out + bias
