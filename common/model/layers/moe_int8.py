"""W8A8-dynamic experts of a MoE layer (layers/moe.py): each expert's gate, up and down
weights int8, symmetric per output channel, activations int8 per token at run time, as
the dense W8A8-dynamic linear (layers/int8_linear.py) computes them:

    per expert e, over the rows routed to it (x_e):
      g|u = int8_mm(q(x_e), W13_e) * s_x * s13_e        q: backend.quantize_per_token
      h   = silu(g) * u
      out = int8_mm(q(h), W2_e) * s_h * s2_e

Checkpoint tensors of each expert projection (per-expert names only: `<layer>.mlp.experts.
{e}.{gate,up,down}_proj.`): `weight` int8 [out, in], `weight_scale` [out, 1], and from
msModelSlim `weight_offset` [out, 1], which must be zeros. Both msModelSlim's
W8A8_DYNAMIC (divisor 127) and compressed-tensors' int8 channel/token scheme (127.5) are
read (vLLM-Ascend holds the same as w13_weight [E, 2I, H] int8 with w13_weight_scale
[E, 2I, 1]: so do we, flat). Split by columns, a rank's down projection quantizes its own
columns of h per token (as the dense row-parallel layer does).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from common.model.layers.int8_linear import Int8DynamicLinearMethod
from common.model.layers.weight_slots import Slot, new_param

if TYPE_CHECKING:
    from kernels import Backend


class Int8ExpertScales(nn.Module):
    """The scales (and zero offsets) beside int8 w13 [n * 2i, h] and w2 [n * h, i], and the
    experts' W8A8 gated MLP once prepared."""

    def __init__(self, num_local: int, inter: int, hidden: int, method: Int8DynamicLinearMethod):
        super().__init__()
        self.num_local, self.inter, self.hidden = num_local, inter, hidden
        self.divisor, self.has_offsets = method.divisor, method.weight_offset
        self.w13_scale = new_param(num_local * 2 * inter, 1, dtype=torch.float32)
        self.w2_scale = new_param(num_local * hidden, 1, dtype=torch.float32)
        if self.has_offsets:
            self.w13_offset = new_param(num_local * 2 * inter, 1, dtype=torch.float32)
            self.w2_offset = new_param(num_local * hidden, 1, dtype=torch.float32)
        self.w13_q: list = []
        self.w2_q: list = []

    def suffixes(self) -> list[str]:
        return ["weight_scale", "weight_offset"] if self.has_offsets else ["weight_scale"]

    def slots(self, local: int, gate: str, up: str, down: str, full_inter: int, rows: tuple | None) -> dict[str, Slot]:
        """The scale (and offset) slots of local expert `local`; gate/up/down: the
        projections' prefixes ("....experts.3.gate_proj."); rows: this rank's rows of gate and
        up (None: all)."""
        i, h = self.inter, self.hidden
        slots = {}
        for suffix in self.suffixes():
            p13 = self.w13_scale if suffix == "weight_scale" else self.w13_offset
            p2 = self.w2_scale if suffix == "weight_scale" else self.w2_offset
            slots[gate + suffix] = Slot(p13, local * 2 * i, local * 2 * i + i, (full_inter, 1), rows, optional=True)
            slots[up + suffix] = Slot(p13, local * 2 * i + i, (local + 1) * 2 * i, (full_inter, 1), rows,
                                      optional=True)
            slots[down + suffix] = Slot(p2, local * h, (local + 1) * h, (h, 1), optional=True)
        return slots

    def prepare(self, w13: nn.Parameter, w2: nn.Parameter, backend: Backend, names: Callable[[int], list[str]]) -> None:
        """After loading (and .to(device)): the backend's form of each expert's codes (the
        codes released when it made copies); the offsets checked to be zeros and dropped.
        names(local expert) -> its gate, up and down prefixes, for the errors."""
        if self.has_offsets:
            self._check_zero_offsets(names)
        n, i, h = self.num_local, self.inter, self.hidden
        codes13, codes2 = w13.data.view(n, 2 * i, h), w2.data.view(n, h, i)
        self.w13_q = [backend.prepare_int8_weight(codes13[e]) for e in range(n)]
        self.w2_q = [backend.prepare_int8_weight(codes2[e]) for e in range(n)]
        if not all(_shares_storage(q, w13.data) for q in self.w13_q):
            w13.data = w13.data.new_empty(0)
        if not all(_shares_storage(q, w2.data) for q in self.w2_q):
            w2.data = w2.data.new_empty(0)
        self.w13_scale.data = self.w13_scale.data.view(n, 1, 2 * i).contiguous()
        self.w2_scale.data = self.w2_scale.data.view(n, 1, h).contiguous()

    def _check_zero_offsets(self, names: Callable[[int], list[str]]) -> None:
        """ValueError naming the first expert projection whose weight_offset is not zeros."""
        i, h = self.inter, self.hidden
        for offsets, rows_of in ((self.w13_offset, lambda r: (r // (2 * i), (r % (2 * i)) // i)),
                                 (self.w2_offset, lambda r: (r // h, 2))):
            bad = offsets.data.reshape(-1).ne(0).nonzero()
            if bad.numel():
                local, which = rows_of(int(bad[0]))
                raise ValueError(f"{names(local)[which]}weight_offset is not all zeros: asymmetric int8 weights "
                                 f"are not supported; supported: symmetric (weight_offset 0)")
            offsets.data = offsets.data.new_empty(0)

    def expert_mlp(self, backend: Backend) -> Callable[[int, torch.Tensor], torch.Tensor]:
        """mlp(e, rows [m, hidden]) -> [m, hidden] in rows' dtype: local expert e's gated MLP."""
        if not self.w13_q:
            raise RuntimeError("int8 experts: prepare() must run after loading, before forward")

        def mlp(e: int, rows: torch.Tensor) -> torch.Tensor:
            x_q, x_s = backend.quantize_per_token(rows, self.divisor)
            gate_up = backend.int8_scaled_matmul(x_q, self.w13_q[e], self.w13_scale[e], row_scale=x_s,
                                                 out_dtype=rows.dtype)
            h = backend.silu_and_mul(gate_up)
            h_q, h_s = backend.quantize_per_token(h, self.divisor)
            return backend.int8_scaled_matmul(h_q, self.w2_q[e], self.w2_scale[e], row_scale=h_s, out_dtype=rows.dtype)
        return mlp


def _shares_storage(prepared, codes: torch.Tensor) -> bool:
    """Whether the backend's form of an expert is a view of the codes (CPU: a transpose)."""
    parts = prepared if isinstance(prepared, (list, tuple)) else [prepared]
    return all(isinstance(p, torch.Tensor) and p.untyped_storage().data_ptr() == codes.untyped_storage().data_ptr()
               for p in parts)
