"""The router of a Mixture-of-Experts layer: which experts each token goes to, and with
what weight. transformers 5 is the reference for every family:

    softmax top-k          p = softmax(logits); top-k of p; renormalised to sum 1 when
                           `renormalize` (Mixtral always; Qwen3-MoE if norm_topk_prob)
    deepseek_v3            s = sigmoid(logits) in float32; the choice uses s + bias
                           (e_score_correction_bias): each of n_group groups scored by the
                           sum of its top 2, the best topk_group groups kept, top-k of those;
                           weights = the chosen s (unbiased), / (their sum + 1e-20) when
                           norm_topk_prob, * routed_scaling_factor
    deepseek_v2            p = softmax(logits) in float32; "greedy" top-k, or
                           "group_limited_greedy": groups scored by their max, the best
                           topk_group kept, top-k of those; * routed_scaling_factor, never
                           renormalised

    router(x [tokens, hidden], backend) -> (weights float32 [tokens, top_k], expert_ids int64 [tokens, top_k])

route() is the reference for every rule; given a kernel backend, the router runs softmax
top-k and DeepSeek-V3's rule through it (Backend.softmax_top_k, sigmoid_grouped_top_k: on the
npu backend npu_moe_gating_top_k_softmax and npu_moe_gating_top_k).

The order of the k chosen experts is unspecified (the layer sums over them). The gate is
replicated on every rank (`<prefix>gate.weight` [num_experts, hidden]; DeepSeek-V3 also
`<prefix>gate.e_score_correction_bias` [num_experts]).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from common.model.layers.weight_slots import Slot, new_param
from kernels.moe import keep_best_groups, sigmoid_grouped_top_k, softmax_top_k

if TYPE_CHECKING:
    from common.model.config import ModelConfig
    from kernels import Backend

ROUTING = ("softmax", "deepseek_v3", "deepseek_v2")
TOPK_METHODS = ("greedy", "group_limited_greedy")


@dataclass(frozen=True)
class RouterConfig:
    routing: str                     # one of ROUTING
    num_experts: int
    top_k: int
    renormalize: bool = False        # softmax: renormalise the top-k; deepseek_v3: norm_topk_prob
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    topk_method: str = "greedy"      # deepseek_v2

    def __post_init__(self) -> None:
        if self.routing not in ROUTING:
            raise ValueError(f"routing must be one of {ROUTING}, got {self.routing!r}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], got {self.top_k}")
        grouped = self.routing == "deepseek_v3" or self.topk_method == "group_limited_greedy"
        if grouped and (self.n_group < 1 or self.num_experts % self.n_group
                        or not 1 <= self.topk_group <= self.n_group):
            raise ValueError(f"n_group must divide num_experts ({self.num_experts}) and topk_group be in "
                             f"[1, n_group], got n_group={self.n_group}, topk_group={self.topk_group}")
        if self.routing == "deepseek_v3" and self.num_experts // self.n_group < 2:
            raise ValueError(f"deepseek_v3 routing scores a group by its top 2 experts: n_group must leave "
                             f"at least 2 experts a group, got {self.num_experts} experts in {self.n_group}")
        if self.routing == "deepseek_v2" and self.topk_method not in TOPK_METHODS:
            raise ValueError(f"topk_method must be one of {TOPK_METHODS}, got {self.topk_method!r}")


def router_config(cfg: ModelConfig) -> RouterConfig:
    """The router of a MoE model's config (ValueError naming the field when it is not one)."""
    return RouterConfig(cfg.moe_routing, cfg.num_experts, cfg.num_experts_per_tok, renormalize=cfg.norm_topk_prob,
                        n_group=cfg.n_group, topk_group=cfg.topk_group,
                        routed_scaling_factor=cfg.routed_scaling_factor, topk_method=cfg.topk_method)


def route(logits: torch.Tensor, cfg: RouterConfig,
          bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [tokens, num_experts] -> (weights float32, expert_ids int64), both [tokens, top_k]."""
    if cfg.routing == "softmax":
        return softmax_top_k(logits, cfg.top_k, cfg.renormalize)
    if cfg.routing == "deepseek_v3":
        return sigmoid_grouped_top_k(logits, bias, cfg.top_k, cfg.n_group, cfg.topk_group, cfg.renormalize,
                                     cfg.routed_scaling_factor)
    probs = torch.softmax(logits.float(), dim=-1)             # deepseek_v2
    if cfg.topk_method == "group_limited_greedy":
        groups = probs.view(-1, cfg.n_group, cfg.num_experts // cfg.n_group).amax(dim=-1)
        probs = keep_best_groups(probs, groups, cfg.topk_group, 0.0)
    weights, ids = probs.topk(cfg.top_k, dim=-1, sorted=False)
    return weights * cfg.routed_scaling_factor, ids


class Router(nn.Module):
    """The gate (replicated on every rank) and the routing rule of cfg. DeepSeek's gate
    runs in float32 whatever the model's dtype (as transformers' does)."""

    def __init__(self, hidden_size: int, cfg: RouterConfig, dtype: torch.dtype):
        super().__init__()
        self.cfg = cfg
        self.weight = new_param(cfg.num_experts, hidden_size,
                                dtype=torch.float32 if cfg.routing != "softmax" else dtype)
        self.bias = new_param(cfg.num_experts, dtype=torch.float32) if cfg.routing == "deepseek_v3" else None

    def weight_slots(self, name: str, optional: bool = False) -> dict[str, Slot]:
        """name: the checkpoint's gate, e.g. "model.layers.3.mlp.gate"."""
        n = self.cfg.num_experts
        slots = {name + ".weight": Slot(self.weight, 0, n, tuple(self.weight.shape), optional=optional)}
        if self.bias is not None:
            slots[name + ".e_score_correction_bias"] = Slot(self.bias, 0, n, (n,), optional=optional)
        return slots

    def forward(self, x: torch.Tensor, backend: Backend | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """backend None: route() itself (the reference)."""
        logits = F.linear(x.to(self.weight.dtype), self.weight)
        cfg = self.cfg
        if backend is not None and cfg.routing == "softmax":
            return backend.softmax_top_k(logits, cfg.top_k, cfg.renormalize)
        if backend is not None and cfg.routing == "deepseek_v3":
            return backend.sigmoid_grouped_top_k(logits, self.bias, cfg.top_k, cfg.n_group, cfg.topk_group,
                                                 cfg.renormalize, cfg.routed_scaling_factor)
        return route(logits, cfg, self.bias)
