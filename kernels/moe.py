"""The routed experts of a Mixture-of-Experts layer, computed by expert rather than by token:
the (token, choice) pairs that go to this rank's experts are sorted by expert, and each
active expert runs one gated MLP over its contiguous run of rows.

    pairs    = [(t, j) for every token t and choice j with ids[t, j] in this rank's experts]
    sorted by expert:  e0 e0 e0 | e2 | e5 e5 | ...      (counts: bincount of the experts)
    per run:           h = silu(x[t] @ gate_e^T) * (x[t] @ up_e^T) @ down_e^T * weights[t, j]
    out[t]  += h                                        (index_add over the run's tokens)

Weights of the local experts: w13 [num_local, 2 * intermediate, hidden] (gate rows then up
rows, transformers 5's `gate_up_proj` layout), w2 [num_local, hidden, intermediate]. Under
expert parallelism a rank holds experts [first_expert, first_expert + num_local); pairs
routed elsewhere contribute nothing here, and the ranks' outputs sum to the whole layer's.
The Python loop runs over active experts (at most num_local), never over tokens.

The routers' rules a kernel backend may run with its own ops are here too (softmax top-k,
DeepSeek-V3's grouped sigmoid top-k); common/model/layers/moe_router.py holds the rest.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


def softmax_top_k(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The softmax top-k router (Qwen3-MoE, Mixtral): logits [tokens, experts] -> (weights
    float32, ids int64) [tokens, top_k]: the top_k of softmax(logits) in float32, descending,
    renormalised to sum 1 when renormalize."""
    weights, ids = torch.softmax(logits.float(), dim=-1).topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def keep_best_groups(choice: torch.Tensor, group_scores: torch.Tensor, topk_group: int,
                     fill: float) -> torch.Tensor:
    """choice [tokens, experts] with every expert outside the topk_group best of the groups
    (group_scores [tokens, n_group], experts in equal consecutive runs) set to fill."""
    best = group_scores.topk(topk_group, dim=-1, sorted=False).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return choice.masked_fill(~keep.repeat_interleave(choice.shape[1] // group_scores.shape[1], dim=1), fill)


def sigmoid_grouped_top_k(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, n_group: int,
                          topk_group: int, renormalize: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's router: logits [tokens, experts] -> (weights float32, ids int64) [tokens,
    top_k]. s = sigmoid(logits) in float32; the choice uses s + bias: each of n_group groups
    scored by the sum of its top 2, the best topk_group kept, top-k of those; weights = the
    chosen s (unbiased), / (their sum + 1e-20) when renormalize, * scaling."""
    scores = logits.float().sigmoid()
    choice = scores if bias is None else scores + bias.float()
    groups = choice.view(choice.shape[0], n_group, -1).topk(2, dim=-1).values.sum(-1)
    ids = keep_best_groups(choice, groups, topk_group, float("-inf")).topk(top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def routed_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
                   w2: torch.Tensor, first_expert: int = 0) -> torch.Tensor:
    """x [tokens, hidden]; weights float [tokens, top_k]; ids int64 [tokens, top_k]; returns
    [tokens, hidden] in x's dtype: this rank's experts' share of the layer's output."""
    def mlp(e: int, rows: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(rows, w13[e]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, w2[e])
    return routed_by_expert(x, weights, ids, w13.shape[0], mlp, first_expert)


def routed_by_expert(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, num_local: int,
                     mlp: Callable[[int, torch.Tensor], torch.Tensor], first_expert: int = 0,
                     all_runs: Callable[[torch.Tensor, list[int]], torch.Tensor | None] | None = None) -> torch.Tensor:
    """routed_experts with any expert computation: mlp(e, rows [m, hidden]) -> [m, hidden]
    for local expert e (e.g. an int8 expert's, layers/moe_int8.py); or all_runs(rows sorted
    by expert, counts per local expert) -> every run's output at once (a fused kernel: the
    cpu backend's), where it returns one (None: the loop over mlp)."""
    top_k = ids.shape[1]
    out = torch.zeros_like(x)
    local = ids.reshape(-1) - first_expert
    mine = ((local >= 0) & (local < num_local)).nonzero().squeeze(1)
    if mine.numel() == 0:
        return out
    experts = local[mine]
    order = experts.argsort(stable=True)
    pairs, experts = mine[order], experts[order]
    tokens = pairs // top_k
    pair_weights = weights.reshape(-1)[pairs]
    counts = torch.bincount(experts, minlength=num_local).tolist()
    rows = x[tokens]                        # one gather; each expert's rows are a slice of it
    done = all_runs(rows, counts) if all_runs is not None else None
    if done is None:
        outs, start = [], 0
        for e, n in enumerate(counts):
            if n:
                outs.append(mlp(e, rows[start:start + n]))
                start += n
        done = torch.cat(outs)
    out.index_add_(0, tokens, done.mul_(pair_weights[:, None].to(x.dtype)))
    return out
