"""A sparse Mixture-of-Experts MLP (Qwen3-MoE, Mixtral, DeepSeek's): a router picks top_k experts per
token (layers/moe_router.py), and each expert's gated MLP runs over the tokens routed to it
(Backend.routed_experts, kernels/moe.py).

Checkpoint layouts, both read (one per checkpoint; never a mix, never a tensor dropped):

    per expert    <layer>.mlp.experts.{e}.gate_proj.weight / up_proj / down_proj, gate
                  <layer>.mlp.gate.weight (Qwen3-MoE);  <layer>.block_sparse_moe.experts.{e}.
                  w1.weight / w3 / w2 (gate, up, down), <layer>.block_sparse_moe.gate.weight (Mixtral)
    fused         <layer>.mlp.experts.gate_up_proj [E, 2I, H], <layer>.mlp.experts.down_proj
                  [E, H, I] (no ".weight"), <layer>.mlp.gate.weight: transformers 5's
                  save_pretrained(save_original_format=False), for both families

The experts are held fused either way: w13 [E * 2I, H] (each expert's gate rows then its up
rows) and w2 [E * H, I], viewed 3-D. At tensor parallelism (common/parallel/shard.py) a rank
holds either experts [expert_start, expert_start + num_local_experts) whole
(enable_expert_parallel; it reads only theirs: the per-expert tensors of the others are
ignored by name, the fused ones read in slices) or every expert's columns [inter_start,
inter_start + I/N) (without it). With the all_reduce dispatch (the default) every rank
routes every token and computes its share, and the group's one all-reduce sums the shares
(vLLM's expert parallelism at data parallel 1); DeepSeek's shared experts (a dense gated
MLP, `<layer>.mlp.shared_experts.*`, split by columns) join that all-reduce. With
all_to_all (layers/moe_dispatch.py) the tokens travel to their experts' ranks and back,
and the shared experts get an all-reduce of their own.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from common.model.layers.float_linear import FloatLinearMethod
from common.model.layers.int8_linear import Int8DynamicLinearMethod
from common.model.layers.mlp import GatedMLP
from common.model.layers.moe_dispatch import all_to_all_experts
from common.model.layers.moe_int8 import Int8ExpertScales
from kernels.moe import routed_by_expert
from common.model.layers.moe_router import Router, RouterConfig
from common.model.layers.weight_slots import Slot, new_param

if TYPE_CHECKING:
    from common.model.layers.quant_config import QuantizationConfig
    from common.parallel.group import TPGroup
    from common.parallel.shard import TPShard
    from kernels import Backend

PER_EXPERT_NAMES = {"qwen3_moe": ("mlp.", ("gate_proj", "up_proj", "down_proj")),
                    "mixtral": ("block_sparse_moe.", ("w1", "w3", "w2"))}    # module, (gate, up, down)
FUSED_MODULE = "mlp."


class SparseMoE(nn.Module):
    """layer_prefix: the checkpoint's name of the decoder layer, e.g. "model.layers.3."."""

    def __init__(self, hidden_size: int, intermediate_size: int, router: RouterConfig, layer_prefix: str,
                 dtype: torch.dtype, shard: TPShard, quant: QuantizationConfig, naming: str = "qwen3_moe",
                 shared_intermediate_size: int = 0):
        super().__init__()
        self.hidden, self.full_inter, self.num_experts = hidden_size, intermediate_size, router.num_experts
        split = shard.size > 1
        self.num_local = shard.num_local_experts if split else router.num_experts
        self.first = shard.expert_start if split else 0
        self.inter = shard.expert_intermediate_size if split else intermediate_size   # this rank's columns
        self.inter_start = shard.expert_inter_start if split else 0
        # DeepSeek's shared experts: one dense gated MLP every token runs, tensor-parallel like
        # the dense MLP; its partial sums join the routed experts' before the one all-reduce
        self.shared: GatedMLP | None = None
        if shared_intermediate_size:
            self.shared = GatedMLP(hidden_size, shared_intermediate_size, shard, quant,
                                   layer_prefix + "mlp.shared_experts.", dtype)
        # tokens routed to each expert (all experts: every rank routes every token), counted
        # in the step; read and reset by whoever exports expert load
        self.register_buffer("expert_tokens", torch.zeros(router.num_experts, dtype=torch.int64), persistent=False)
        module, self.names = PER_EXPERT_NAMES[naming]
        self.per_expert_prefix, self.fused_prefix = layer_prefix + module, layer_prefix + FUSED_MODULE
        self.prefix = self.per_expert_prefix        # for the errors (Mixtral's: block_sparse_moe.)
        self.gate = Router(hidden_size, router, dtype)
        # the experts' quantization (one scheme for all: they are one kind of matmul)
        method = quant.linear_method([f"{self.per_expert_prefix}experts.{e}.{name}"
                                      for e in range(self.num_experts) for name in self.names])
        if not isinstance(method, (FloatLinearMethod, Int8DynamicLinearMethod)):
            raise ValueError(f"{self.prefix}experts: quantization type {method.scheme} is not supported for experts; "
                             f"supported: FLOAT, W8A8_DYNAMIC")
        self.int8 = None if isinstance(method, FloatLinearMethod) else \
            Int8ExpertScales(self.num_local, self.inter, hidden_size, method)
        weight_dtype = torch.int8 if self.int8 is not None else dtype
        self.w13 = new_param(self.num_local * 2 * self.inter, hidden_size, dtype=weight_dtype)
        self.w2 = new_param(self.num_local * hidden_size, self.inter, dtype=weight_dtype)
        self.group: TPGroup | None = None
        self.dispatch = "all_reduce"
        self.prepared: tuple | None = None      # the float experts in the backend's form (prepare)

    def _expert_names(self, e: int, suffix: str = "weight") -> list[str]:
        p = f"{self.per_expert_prefix}experts.{e}."
        return [f"{p}{name}.{suffix}" for name in self.names]

    def _columns(self) -> slice | None:
        """This rank's columns of each expert (None: all of them)."""
        return None if self.inter == self.full_inter else slice(self.inter_start, self.inter_start + self.inter)

    def _per_expert_slots(self) -> dict[str, Slot]:
        h, i, full, cols = self.hidden, self.inter, self.full_inter, self._columns()
        rows, down_cols = (None, None) if cols is None else ((cols,), (slice(None), cols))
        slots = self.gate.weight_slots(self.per_expert_prefix + "gate", optional=True)
        for local in range(self.num_local):
            gate, up, down = self._expert_names(self.first + local)
            slots[gate] = Slot(self.w13, local * 2 * i, local * 2 * i + i, (full, h), rows, optional=True)
            slots[up] = Slot(self.w13, local * 2 * i + i, (local + 1) * 2 * i, (full, h), rows, optional=True)
            slots[down] = Slot(self.w2, local * h, (local + 1) * h, (h, full), down_cols, optional=True)
            if self.int8 is not None:
                gate, up, down = self._expert_names(self.first + local, "")
                slots.update(self.int8.slots(local, gate, up, down, full, rows))
        return slots

    def other_ranks_tensors(self) -> set[str]:
        """The per-expert tensor names of the experts this rank does not hold."""
        mine = range(self.first, self.first + self.num_local)
        suffixes = ["weight", *(self.int8.suffixes() if self.int8 is not None else ())]
        return {n for e in range(self.num_experts) if e not in mine for s in suffixes for n in self._expert_names(e, s)}

    def _fused_slots(self) -> dict[str, Slot]:
        e, n, h, i, full, p = self.num_experts, self.num_local, self.hidden, self.inter, self.full_inter, self.fused_prefix
        cols = self._columns()
        mine = slice(self.first, self.first + n)
        # split by columns: each expert's gate and up rows are two runs of [E, 2Ie, H], so the
        # rank reads its experts whole and keeps its runs (down's columns are one slice)
        return {**self.gate.weight_slots(p + "gate", optional=True),
                p + "experts.gate_up_proj": Slot(self.w13, 0, n * 2 * i, (e, 2 * full, h), source=(mine,),
                                                 optional=True, convert=_stacked(p + "experts.gate_up_proj", h, cols,
                                                                                 full)),
                p + "experts.down_proj": Slot(self.w2, 0, n * h, (e, h, full),
                                              source=(mine,) if cols is None else (mine, slice(None), cols),
                                              optional=True, convert=_stacked(p + "experts.down_proj", i))}

    def weight_slots(self, prefix: str = "") -> dict[str, Slot]:
        """Both layouts' names, optional (the layer knows its names; prefix is unused):
        check_layout says whether one came whole."""
        shared = self.shared.weight_slots(self.per_expert_prefix + "shared_experts.") if self.shared else {}
        return {**self._per_expert_slots(), **self._fused_slots(), **shared}

    def attach_group(self, group: TPGroup, dispatch: str = "all_reduce") -> None:
        """After the model's linears got theirs: the shared experts' row-parallel down
        projection leaves its partial sums to this layer's one all-reduce. dispatch: how
        tokens reach the experts of other ranks (layers/moe_dispatch.py); all_to_all only
        with the experts placed whole."""
        if dispatch == "all_to_all" and self.num_local == self.num_experts:
            raise ValueError("moe_dispatch: all_to_all needs the experts placed whole (enable_expert_parallel: true)")
        self.group, self.dispatch = group, dispatch
        if self.shared is not None:
            self.shared.down.group = None

    def check_layout(self, loaded: set[str]) -> None:
        """After loading: ValueError naming the tensors unless exactly one layout was read
        whole (a mix, or a partial one, would leave experts of garbage)."""
        layouts = {"per expert": set(self._per_expert_slots()), "fused": set(self._fused_slots())}
        shared = layouts["per expert"] & layouts["fused"]          # Qwen3-MoE's gate: both layouts name it
        found = [name for name, names in layouts.items() if (names - shared) & loaded]
        if len(found) != 1:
            raise ValueError(f"{self.prefix}experts: the checkpoint must hold the experts in one layout, per expert "
                             f"({self.per_expert_prefix}experts.N.{self.names[0]}.weight ...) or fused "
                             f"({self.fused_prefix}experts.gate_up_proj, down_proj); found "
                             f"{' and '.join(found) if found else 'neither'}")
        missing = sorted(layouts[found[0]] - loaded)
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ValueError(f"{self.prefix}experts: checkpoint is missing {len(missing)} tensor(s): {shown}")

    def _views(self) -> tuple[torch.Tensor, torch.Tensor]:
        n, i, h = self.num_local, self.inter, self.hidden
        return self.w13.data.view(n, 2 * i, h), self.w2.data.view(n, h, i)

    def prepare(self, backend: Backend) -> None:
        """After loading and .to(device), once: the experts take the backend's form (the
        dense storage released when the backend made another)."""
        if self.int8 is not None:
            self.int8.prepare(self.w13, self.w2, backend, lambda local: self._expert_names(self.first + local, ""))
            return
        w13, w2 = self._views()
        self.prepared = backend.prepare_experts(w13, w2)
        if self.prepared[0] is not w13:
            self.w13.data, self.w2.data = self.w13.data.new_empty(0), self.w2.data.new_empty(0)

    def run_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, backend: Backend,
                    first_expert: int) -> torch.Tensor:
        """This rank's experts over the (token, choice) pairs routed to them (kernels/moe.py)."""
        if self.int8 is not None:
            return routed_by_expert(x, weights, ids, self.num_local, self.int8.expert_mlp(backend), first_expert)
        w13, w2 = self.prepared if self.prepared is not None else self._views()
        return backend.routed_experts(x, weights, ids, w13, w2, first_expert=first_expert)

    def forward(self, x: torch.Tensor, backend: Backend) -> torch.Tensor:
        if self.dispatch == "all_to_all" and self.group is not None:
            out = all_to_all_experts(self, x, self.group, backend)
            return out if self.shared is None else out + self.group.all_reduce(self.shared(x, backend))
        weights, ids = self.gate(x, backend)
        self.expert_tokens += torch.bincount(ids.reshape(-1), minlength=self.num_experts)
        out = self.run_experts(x, weights, ids, backend, self.first)
        if self.shared is not None:
            out = out + self.shared(x, backend)
        return out if self.group is None else self.group.all_reduce(out)


def _stacked(name: str, width: int, gate_up_cols: slice | None = None, full_inter: int = 0):
    """The file's [E, rows, width] experts as the parameter's [E * rows, width] (with
    gate_up_cols: of each expert's [gate; up] rows, those columns of both); ValueError for
    integer codes (quantized experts are read per expert, with their scales)."""
    def convert(t: torch.Tensor) -> torch.Tensor:
        if not t.dtype.is_floating_point:
            raise ValueError(f"tensor {name!r} is {str(t.dtype).removeprefix('torch.')}: fused quantized experts "
                             f"are not supported; supported: float fused experts, or int8 experts per expert "
                             f"(experts.N.gate_proj.weight with its weight_scale)")
        if gate_up_cols is not None:
            up = slice(full_inter + gate_up_cols.start, full_inter + gate_up_cols.stop)
            t = torch.cat([t[:, gate_up_cols], t[:, up]], dim=1)
        return t.reshape(-1, width)
    return convert
