"""DeepSeek-V2/V3's MoE layer (routed experts of a grouped router, plus shared experts;
layers/moe.py) against transformers' DeepseekV2Moe / DeepseekV3MoE on the same weights,
read from a checkpoint by the layer's own slots (fused and per-expert), whole and split over two ranks (experts
placed whole, or split by columns): the ranks' shares sum to the layer. The whole DeepSeek
models need MLA (their attention), a separate issue; their MLP is this layer."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from common.model.layers.linear import Linear
from common.model.layers.moe import SparseMoE
from common.model.layers.moe_router import RouterConfig
from common.model.layers.quant_config import FloatConfig
from common.model.loading import load_weights
from common.parallel.shard import TPShard
from kernels import get_backend

HIDDEN, INTER, EXPERTS, SHARED, TOKENS = 64, 32, 8, 2, 29
PREFIX = "model.layers.0."


def deepseek(family: str):
    """(transformers' MoE module with random weights, our RouterConfig for it)."""
    if family == "deepseek_v3":
        from transformers import DeepseekV3Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE as Moe
        cfg = DeepseekV3Config(hidden_size=HIDDEN, moe_intermediate_size=INTER, n_routed_experts=EXPERTS,
                               n_shared_experts=SHARED, num_experts_per_tok=3, n_group=4, topk_group=2,
                               norm_topk_prob=True, routed_scaling_factor=2.5)
        router = RouterConfig("deepseek_v3", EXPERTS, 3, renormalize=True, n_group=4, topk_group=2,
                              routed_scaling_factor=2.5)
    else:
        from transformers import DeepseekV2Config
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe as Moe
        cfg = DeepseekV2Config(hidden_size=HIDDEN, moe_intermediate_size=INTER, n_routed_experts=EXPERTS,
                               n_shared_experts=SHARED, num_experts_per_tok=3, n_group=4, topk_group=2,
                               topk_method="group_limited_greedy", routed_scaling_factor=1.5)
        router = RouterConfig("deepseek_v2", EXPERTS, 3, n_group=4, topk_group=2,
                              topk_method="group_limited_greedy", routed_scaling_factor=1.5)
    moe = Moe(cfg).eval()
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return moe, router


class _OneLayer:
    """A Loadable of one MoE layer (common/model/loading.py)."""

    def __init__(self, layer: SparseMoE):
        self.layer = layer

    def weight_slots(self):
        return self.layer.weight_slots()

    def ignored_tensors(self):
        return self.layer.other_ranks_tensors(), ()


def shard(rank: int, size: int, expert_parallel: bool) -> TPShard:
    experts = dict(num_local_experts=EXPERTS // size, expert_start=rank * EXPERTS // size,
                   expert_intermediate_size=INTER) if expert_parallel else \
        dict(num_local_experts=EXPERTS, expert_intermediate_size=INTER // size, expert_inter_start=rank * INTER // size)
    return TPShard(rank=rank, size=size, num_heads=0, num_kv_heads=0, kv_head_start=0, intermediate_size=0,
                   vocab_start=0, vocab_end=0, vocab_per_rank=0, **experts)


def ours(router: RouterConfig, folder, part: TPShard, backend) -> SparseMoE:
    layer = SparseMoE(HIDDEN, INTER, router, PREFIX, torch.float32, part, FloatConfig(),
                      shared_intermediate_size=INTER * SHARED)
    loaded = load_weights(_OneLayer(layer), folder, torch.float32, "the layer")
    layer.check_layout(loaded)
    for m in layer.modules():
        if isinstance(m, Linear):
            m.prepare(backend)
    return layer


def per_expert(state: dict) -> dict:
    """transformers 5's fused experts as the hub's per-expert tensors (experts.N.gate_proj...)."""
    out = {k: v for k, v in state.items() if not k.startswith("experts.")}
    for e, (gate_up, down) in enumerate(zip(state["experts.gate_up_proj"], state["experts.down_proj"])):
        out[f"experts.{e}.gate_proj.weight"], out[f"experts.{e}.up_proj.weight"] = gate_up.chunk(2)
        out[f"experts.{e}.down_proj.weight"] = down
    return out


@pytest.fixture(scope="module", params=[("deepseek_v3", "fused"), ("deepseek_v2", "fused"),
                                        ("deepseek_v3", "per-expert")], ids=lambda p: "-".join(p))
def family(request, tmp_path_factory):
    name, layout = request.param
    theirs, router = deepseek(name)
    folder = tmp_path_factory.mktemp(name)
    state = theirs.state_dict()
    state = per_expert(state) if layout == "per-expert" else state
    save_file({PREFIX + "mlp." + name: t.contiguous() for name, t in state.items()}, folder / "model.safetensors")
    return theirs, router, folder


@pytest.mark.parametrize("split", ["whole", "expert parallel", "columns"])
def test_deepseek_moe_layer_equals_transformers(family, split):
    theirs, router, folder = family
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(3))
    backend = get_backend("cpu", "cpu")
    with torch.no_grad():
        want = theirs(x[None])[0]
        parts = [shard(0, 1, True)] if split == "whole" else [shard(r, 2, split == "expert parallel") for r in (0, 1)]
        layers = [ours(router, folder, p, backend) for p in parts]
        got = sum(layer(x, backend) for layer in layers)     # the all-reduce's sum
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert layers[0].shared is not None
    if split == "expert parallel":                        # each rank: its 4 experts, half the shared columns
        assert [(m.first, m.num_local) for m in layers] == [(0, 4), (4, 4)]
        assert [m.shared.down.in_features for m in layers] == [INTER * SHARED // 2] * 2
    if split == "columns":
        assert [(m.num_local, m.inter_start, m.inter) for m in layers] == [(8, 0, 16), (8, 16, 16)]
    counted = sum(layers[0].expert_tokens.tolist())       # every rank routes every token
    assert counted == TOKENS * 3
