"""The MoE routers (common/model/layers/moe_router.py) against transformers' own router
modules on the same gate weights and inputs: the same experts, the same weights."""
from __future__ import annotations

import pytest
import torch

from common.model.layers.moe_router import Router, RouterConfig, route

HIDDEN, EXPERTS, TOKENS = 64, 16, 40


def by_expert(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = ids.argsort(dim=-1)
    return weights.gather(1, order), ids.gather(1, order)


def same_routing(ours, theirs) -> None:
    (w, i), (tw, ti) = by_expert(*ours), by_expert(theirs[1].float(), theirs[2])
    assert torch.equal(i, ti)
    torch.testing.assert_close(w, tw, rtol=1e-6, atol=1e-7)


def hidden(seed: int) -> torch.Tensor:
    return torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(seed))


def randomize(module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        module.weight.copy_(torch.randn(module.weight.shape, generator=g) * 0.3)
        if hasattr(module, "e_score_correction_bias"):
            module.e_score_correction_bias.copy_(torch.randn(EXPERTS, generator=g) * 0.2)


def ours_from(theirs, cfg: RouterConfig) -> Router:
    router = Router(HIDDEN, cfg, torch.float32)
    with torch.no_grad():
        router.weight.copy_(theirs.weight)
        if router.bias is not None:
            router.bias.copy_(theirs.e_score_correction_bias)
    return router


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_qwen3_moe(norm_topk_prob):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter
    theirs = Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=HIDDEN, num_experts=EXPERTS, num_experts_per_tok=4,
                                               norm_topk_prob=norm_topk_prob))
    randomize(theirs, 1)
    ours = ours_from(theirs, RouterConfig("softmax", EXPERTS, 4, renormalize=norm_topk_prob))
    x = hidden(2)
    same_routing(ours(x), theirs(x))


def test_mixtral():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    theirs = MixtralTopKRouter(MixtralConfig(hidden_size=HIDDEN, num_local_experts=EXPERTS, num_experts_per_tok=2))
    randomize(theirs, 3)
    ours = ours_from(theirs, RouterConfig("softmax", EXPERTS, 2, renormalize=True))
    x = hidden(4)
    same_routing(ours(x), theirs(x))


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_deepseek_v3(norm_topk_prob):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    cfg = DeepseekV3Config(hidden_size=HIDDEN, n_routed_experts=EXPERTS, num_experts_per_tok=4, n_group=4,
                           topk_group=2, norm_topk_prob=norm_topk_prob, routed_scaling_factor=2.5)
    theirs = DeepseekV3TopkRouter(cfg)
    randomize(theirs, 5)
    ours = ours_from(theirs, RouterConfig("deepseek_v3", EXPERTS, 4, renormalize=norm_topk_prob, n_group=4,
                                          topk_group=2, routed_scaling_factor=2.5))
    x = hidden(6)
    same_routing(ours(x), theirs(x))
    # the bias steers the choice only: the weights are the unbiased scores of the chosen
    weights, ids = ours(x)
    scores = torch.sigmoid(x @ ours.weight.t()).gather(1, ids)
    expected = scores / (scores.sum(-1, keepdim=True) + 1e-20) if norm_topk_prob else scores
    torch.testing.assert_close(weights, expected * 2.5)
    # and only experts of the 2 best groups (of 4 experts each) are chosen
    assert all(len(set((row // 4).tolist())) <= 2 for row in ids)


@pytest.mark.parametrize("topk_method", ["greedy", "group_limited_greedy"])
def test_deepseek_v2(topk_method):
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    cfg = DeepseekV2Config(hidden_size=HIDDEN, n_routed_experts=EXPERTS, num_experts_per_tok=3, n_group=4,
                           topk_group=2, topk_method=topk_method, routed_scaling_factor=1.5)
    theirs = DeepseekV2TopkRouter(cfg)
    randomize(theirs, 7)
    ours = ours_from(theirs, RouterConfig("deepseek_v2", EXPERTS, 3, n_group=4, topk_group=2,
                                          topk_method=topk_method, routed_scaling_factor=1.5))
    x = hidden(8)
    same_routing(ours(x), theirs(x))


def test_the_checkpoint_names_of_a_gate():
    router = Router(HIDDEN, RouterConfig("deepseek_v3", EXPERTS, 2, n_group=2, topk_group=1), torch.bfloat16)
    slots = router.weight_slots("model.layers.3.mlp.gate")
    assert sorted(slots) == ["model.layers.3.mlp.gate.e_score_correction_bias", "model.layers.3.mlp.gate.weight"]
    assert router.weight.dtype == torch.float32          # DeepSeek's gate runs in float32
    assert sorted(Router(HIDDEN, RouterConfig("softmax", EXPERTS, 2), torch.bfloat16).weight_slots("g")) == ["g.weight"]


@pytest.mark.parametrize("kwargs,match", [
    (dict(routing="topk"), r"routing must be one of \('softmax', 'deepseek_v3', 'deepseek_v2'\)"),
    (dict(top_k=17), r"num_experts_per_tok must be in \[1, num_experts=16\], got 17"),
    (dict(routing="deepseek_v3", n_group=3), "n_group must divide num_experts"),
    (dict(routing="deepseek_v3", n_group=4, topk_group=5), r"topk_group be in \[1, n_group\]"),
    (dict(routing="deepseek_v3", n_group=16), "at least 2 experts a group"),
    (dict(routing="deepseek_v2", topk_method="noaux_tc"), r"topk_method must be one of \('greedy'"),
])
def test_a_bad_router_config_names_the_field(kwargs, match):
    args = dict(routing="softmax", num_experts=EXPERTS, top_k=2) | kwargs
    with pytest.raises(ValueError, match=match):
        RouterConfig(**args)


def test_route_runs_on_logits_alone():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    weights, ids = route(logits, RouterConfig("softmax", 4, 2, renormalize=True))
    p = torch.softmax(torch.tensor([2.0, 1.0]), 0)
    assert ids.tolist() == [[1, 2]] and torch.allclose(weights[0], p)
