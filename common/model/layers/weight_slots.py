"""Where each checkpoint tensor lands: a `Slot` is rows of one (possibly fused) parameter,
filled from a part of one checkpoint tensor.

A fused parameter stacks the rows of several checkpoint tensors (q/k/v -> qkv); a
tensor-parallel rank reads only its part of each tensor (safetensors get_slice):

    checkpoint k_proj.weight [full_kv, hidden]       fused qkv [q + 2 kv, hidden] of rank r
      rows [kv0, kv0 + kv)  ------------------------>  rows [q, q + kv)

Loading (common/model/loading.py) checks every tensor's full shape against `full_shape`
before it copies `tensor[source]` into `param[start:end]`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn


@dataclass(frozen=True)
class Slot:
    """Rows [start, end) of param, from the part `source` of the checkpoint tensor (None =
    all of it), whose full shape must be full_shape."""

    param: nn.Parameter
    start: int
    end: int
    full_shape: tuple[int, ...]
    source: tuple[slice, ...] | None = None
    convert: Callable[[torch.Tensor], torch.Tensor] | None = None   # the file's form -> the param's
    optional: bool = False        # a tensor some producers write and others do not


def new_param(*shape: int, dtype: torch.dtype, zeros: bool = False) -> nn.Parameter:
    """An inference parameter (no grad); zeros where some rows are padding no tensor fills."""
    make = torch.zeros if zeros else torch.empty
    return nn.Parameter(make(*shape, dtype=dtype), requires_grad=False)


def rows_slot(param: nn.Parameter, start: int, end: int, full_rows: int, src_start: int) -> Slot:
    """param rows [start, end) from the checkpoint rows [src_start, ...) of a tensor of
    full_rows rows (its other dims: param's)."""
    full = (full_rows, *param.shape[1:])
    if src_start == 0 and end - start == full_rows:
        return Slot(param, start, end, full)
    return Slot(param, start, end, full, (slice(src_start, src_start + end - start),))


def whole_slot(param: nn.Parameter) -> Slot:
    """All of param from all of a tensor of param's shape."""
    return Slot(param, 0, param.shape[0], tuple(param.shape))


def cols_slot(param: nn.Parameter, full_cols: int, src_start: int) -> Slot:
    """All of param from the checkpoint columns [src_start, ...) of a [rows, full_cols] tensor."""
    full = (param.shape[0], full_cols)
    if src_start == 0 and param.shape[1] == full_cols:
        return Slot(param, 0, param.shape[0], full)
    return Slot(param, 0, param.shape[0], full, (slice(None), slice(src_start, src_start + param.shape[1])))
