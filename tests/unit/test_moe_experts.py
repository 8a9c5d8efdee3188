"""The routed experts computed expert by expert (kernels/moe.py) against
transformers' Qwen3MoeExperts on the same fused weights, and split across ranks (expert
parallelism): each rank's share for its experts, summing to the whole."""
from __future__ import annotations

import pytest
import torch

from kernels.moe import routed_experts
from common.model.layers.moe_router import RouterConfig, route

HIDDEN, INTER, EXPERTS, TOP_K, TOKENS = 48, 32, 8, 2, 37


@pytest.fixture(scope="module")
def theirs():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts
    experts = Qwen3MoeExperts(Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTER, num_experts=EXPERTS))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=g) * 0.2)
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=g) * 0.2)
    return experts


def routing(seed: int, num_tokens: int = TOKENS):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=g)
    logits = torch.randn(num_tokens, EXPERTS, generator=g) * 2
    logits[:, 5] = -30                                    # expert 5 never chosen: an idle expert
    weights, ids = route(logits, RouterConfig("softmax", EXPERTS, TOP_K, renormalize=True))
    return x, weights, ids


def test_expert_by_expert_equals_transformers(theirs):
    x, weights, ids = routing(1)
    assert 5 not in ids.unique().tolist()
    with torch.no_grad():
        want = theirs(x, ids, weights)
        got = routed_experts(x, weights, ids, theirs.gate_up_proj, theirs.down_proj)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("ranks", [2, 4])
def test_expert_parallel_shares_sum_to_the_whole(theirs, ranks):
    x, weights, ids = routing(2)
    per = EXPERTS // ranks
    with torch.no_grad():
        whole = routed_experts(x, weights, ids, theirs.gate_up_proj, theirs.down_proj)
        shares = [routed_experts(x, weights, ids, theirs.gate_up_proj[r * per:(r + 1) * per],
                                 theirs.down_proj[r * per:(r + 1) * per], first_expert=r * per)
                  for r in range(ranks)]
    torch.testing.assert_close(sum(shares), whole, rtol=1e-5, atol=1e-6)
    # a share holds exactly the tokens that chose one of its experts
    for r, share in enumerate(shares):
        routed_here = ((ids >= r * per) & (ids < (r + 1) * per)).any(-1)
        assert torch.equal(share.abs().sum(-1) > 0, routed_here)


def test_no_token_for_this_rank_gives_zeros(theirs):
    x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(3))
    ids = torch.tensor([[0, 1], [2, 3], [1, 3]])           # every choice among experts 0..3
    weights = torch.full((3, 2), 0.5)
    with torch.no_grad():
        out = routed_experts(x, weights, ids, theirs.gate_up_proj[4:], theirs.down_proj[4:], first_expert=4)
        mine = routed_experts(x, weights, ids, theirs.gate_up_proj[:4], theirs.down_proj[:4])
    assert torch.equal(out, torch.zeros_like(x)) and bool((mine.abs().sum(-1) > 0).all())
