"""How an expert-parallel MoE layer's tokens reach the ranks that hold their experts, and
the experts' outputs come back (`EngineConfig.moe_dispatch`). Every rank holds the step's
whole batch (attention is tensor-parallel, data parallel is 1).

    all_reduce    every rank routes every token and runs its experts on the rows routed
                  to them; the group's all-reduce sums the ranks' shares (vLLM's EP at
                  DP 1). Moves [tokens, hidden] once (the all-reduce).
    all_to_all    rank r routes only its chunk of the tokens (rows [r*c, (r+1)*c), c =
                  ceil(tokens / N)); the ranks all-gather their per-expert counts, send
                  each (token, choice) row to the rank holding its expert
                  (all_to_all_single by counts, rows sorted by expert, so the receiver
                  knows each row's expert from the counts alone), run their experts, send
                  the outputs back the same way, weight and sum them per token, and
                  all-gather the chunks. Moves 2 x (top_k x tokens x (N-1)/N) rows plus
                  the all-gather: the shape of DeepEP / Ascend MC2 dispatch, which pays off
                  when data parallelism gives each rank tokens of its own.

bench/moe_step.py measures both on gloo; all_reduce is the default (faster at DP 1).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from common.model.layers.moe import SparseMoE
    from common.parallel.group import TPGroup
    from kernels import Backend


def all_to_all_experts(layer: SparseMoE, x: torch.Tensor, group: TPGroup, backend: Backend) -> torch.Tensor:
    """The routed experts' output [tokens, hidden] of the whole batch, on every rank, by
    all_to_all dispatch; counts the tokens per expert into layer.expert_tokens (all of
    them: the counts are all-gathered)."""
    n, rank, num_local = group.size, group.rank, layer.num_local
    tokens = x.shape[0]
    chunk = -(-tokens // n)
    mine = x[rank * chunk:min((rank + 1) * chunk, tokens)]
    top_k = layer.gate.cfg.top_k
    if mine.shape[0]:
        weights, ids = layer.gate(mine, backend)
    else:       # fewer tokens than ranks (a small decode step): this rank routes none
        weights = torch.empty(0, top_k, dtype=torch.float32, device=x.device)
        ids = torch.empty(0, top_k, dtype=torch.int64, device=x.device)
    counts = torch.bincount(ids.reshape(-1), minlength=layer.num_experts)
    every = group.all_gather(counts[None]).view(n, n, num_local)          # [source, owner, local expert]
    layer.expert_tokens += every.sum(0).reshape(-1)
    send_rows = every[rank].sum(1).tolist()
    from_each = every[:, rank]                                              # [source, local expert]
    recv_rows = from_each.sum(1).tolist()
    order = ids.reshape(-1).argsort(stable=True)                           # pairs sorted by expert
    rows = order // top_k
    received = group.all_to_all(mine[rows], recv_rows, send_rows)
    local_ids = torch.arange(num_local, device=x.device).repeat(n).repeat_interleave(from_each.reshape(-1))
    ones = torch.ones(received.shape[0], 1, dtype=torch.float32, device=x.device)
    out_rows = layer.run_experts(received, ones, local_ids[:, None], backend, first_expert=0)
    back = group.all_to_all(out_rows, send_rows, recv_rows)
    pair_weights = weights.reshape(-1)[order].to(x.dtype)[:, None]
    padded = x.new_zeros(chunk, x.shape[1])
    padded.index_add_(0, rows, back * pair_weights)
    return group.all_gather(padded)[:tokens]
