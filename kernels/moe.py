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
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def routed_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
                   w2: torch.Tensor, first_expert: int = 0) -> torch.Tensor:
    """x [tokens, hidden]; weights float [tokens, top_k]; ids int64 [tokens, top_k]; returns
    [tokens, hidden] in x's dtype: this rank's experts' share of the layer's output."""
    num_local, top_k = w13.shape[0], ids.shape[1]
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
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = tokens[start:start + n]
        gate, up = F.linear(x[rows], w13[e]).chunk(2, dim=-1)
        h = F.linear(F.silu(gate) * up, w2[e]) * pair_weights[start:start + n, None].to(x.dtype)
        out.index_add_(0, rows, h)
        start += n
    return out
