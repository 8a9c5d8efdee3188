"""The Mixture-of-Experts path of the npu kernel backend through the torch_npu emulator:
its routers (npu_moe_gating_top_k_softmax; DeepSeek-V3's npu_moe_gating_top_k) and routed experts (npu_moe_init_routing_v2 ->
npu_grouped_matmul -> npu_swiglu -> npu_grouped_matmul -> npu_moe_finalize_routing) against
the reference (kernels/moe.py, moe_router.route), whole and split by expert parallelism,
and the tiny Qwen3-MoE and Mixtral through the engine against transformers."""
from __future__ import annotations

import pytest
import torch

from common.engine import LLM, SamplingParams
from common.model.layers.moe_router import Router, RouterConfig, route
from kernels import get_backend
from kernels.moe import routed_experts
from tests.conftest import assert_no_blocks_in_use
from tests.moe_checkpoints import IDS, greedy_reference, saved  # noqa: F401  (saved: a fixture)

HIDDEN, INTER, EXPERTS, TOP_K, TOKENS = 48, 32, 8, 2, 37
MOE_OPS = ("npu_moe_init_routing_v2", "npu_grouped_matmul", "npu_swiglu", "npu_moe_finalize_routing")


def experts(dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) * 0.2
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, generator=g) * 0.2
    return w13.to(dtype), w2.to(dtype)


def routing(seed: int, num_tokens: int = TOKENS, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=g)
    logits = torch.randn(num_tokens, EXPERTS, generator=g) * 2
    logits[:, 5] = -30                                    # expert 5 never chosen: an idle expert
    weights, ids = route(logits, RouterConfig("softmax", EXPERTS, TOP_K, renormalize=True))
    return x.to(dtype), weights, ids


@pytest.mark.parametrize("renormalize", [True, False])
def test_the_router_through_gating_top_k_softmax_equals_route(npu_op_calls, renormalize):
    backend = get_backend("npu", "cpu")
    cfg = RouterConfig("softmax", EXPERTS, 3, renormalize=renormalize)
    router = Router(HIDDEN, cfg, torch.float32)
    with torch.no_grad():
        router.weight.copy_(torch.randn(EXPERTS, HIDDEN, generator=torch.Generator().manual_seed(3)))
        x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(4))
        weights, ids = router(x, backend)
        want_weights, want_ids = router(x)                  # no backend: route(), the reference
    assert npu_op_calls["npu_moe_gating_top_k_softmax"] == 1
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=0, atol=1e-7)


def deepseek_v3_router(cfg: RouterConfig, hidden: int = HIDDEN) -> Router:
    router = Router(hidden, cfg, torch.bfloat16)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        router.weight.copy_(torch.randn(cfg.num_experts, hidden, generator=g) * 0.3)
        router.bias.copy_(torch.randn(cfg.num_experts, generator=g) * 0.2)
    return router


def test_deepseek_v3_routing_through_gating_top_k_equals_route(npu_op_calls):
    backend = get_backend("npu", "cpu")
    cfg = RouterConfig("deepseek_v3", 32, 4, renormalize=True, n_group=4, topk_group=2, routed_scaling_factor=2.5)
    router = deepseek_v3_router(cfg)
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(6)).bfloat16()
    with torch.no_grad():
        weights, ids = router(x, backend)
        want_weights, want_ids = router(x)
    assert npu_op_calls["npu_moe_gating_top_k"] == 1
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    order, want_order = ids.argsort(-1), want_ids.argsort(-1)            # the order of the k is unspecified
    assert torch.equal(ids.gather(1, order), want_ids.gather(1, want_order))
    torch.testing.assert_close(weights.gather(1, order), want_weights.gather(1, want_order), rtol=0, atol=1e-6)


@pytest.mark.parametrize("cfg", [
    RouterConfig("deepseek_v3", 32, 4, renormalize=False, n_group=4, topk_group=2),    # the op always renormalises
    RouterConfig("deepseek_v3", 16, 2, renormalize=True, n_group=8, topk_group=2),     # groups of 2: the op wants > 2
])
def test_deepseek_v3_routing_the_op_does_not_take_runs_the_reference(npu_op_calls, cfg):
    router = deepseek_v3_router(cfg)
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(7)).bfloat16()
    with torch.no_grad():
        got, want = router(x, get_backend("npu", "cpu")), router(x)
    assert npu_op_calls["npu_moe_gating_top_k"] == 0
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])


def test_routed_experts_through_the_moe_ops_equal_the_reference(npu_op_calls):
    backend = get_backend("npu", "cpu")
    x, weights, ids = routing(1)
    w13, w2 = experts()
    got = backend.routed_experts(x, weights, ids, w13, w2)
    assert all(npu_op_calls[op] >= 1 for op in MOE_OPS), dict(npu_op_calls)
    torch.testing.assert_close(got, routed_experts(x, weights, ids, w13, w2), rtol=0, atol=1e-6)


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_expert_parallel_shares_equal_the_reference_and_sum_to_the_whole(npu_emulator, ranks):
    backend = get_backend("npu", "cpu")
    x, weights, ids = routing(2)
    w13, w2 = experts()
    per = EXPERTS // ranks
    shares = []
    for r in range(ranks):
        mine = slice(r * per, (r + 1) * per)
        share = backend.routed_experts(x, weights, ids, w13[mine], w2[mine], first_expert=r * per)
        torch.testing.assert_close(share, routed_experts(x, weights, ids, w13[mine], w2[mine], r * per),
                                   rtol=0, atol=1e-6)
        routed_here = ((ids >= r * per) & (ids < (r + 1) * per)).any(-1)
        assert torch.equal(share.abs().sum(-1) > 0, routed_here)      # exact zeros elsewhere
        shares.append(share)
    torch.testing.assert_close(sum(shares), routed_experts(x, weights, ids, w13, w2), rtol=1e-5, atol=1e-6)


def test_a_rank_no_token_chose_and_an_empty_step_give_zeros(npu_op_calls):
    backend = get_backend("npu", "cpu")
    x, weights, ids = routing(3)
    w13, w2 = experts()
    idle = backend.routed_experts(x, weights, ids, w13[5:6], w2[5:6], first_expert=5)   # expert 5 is never chosen
    assert torch.equal(idle, torch.zeros_like(x))
    assert npu_op_calls["npu_grouped_matmul"] == 0
    empty = backend.routed_experts(x[:0], weights[:0], ids[:0], w13, w2)
    assert empty.shape == (0, HIDDEN)


def test_half_precision_experts_stay_close_to_the_float_reference(npu_emulator):
    backend = get_backend("npu", "cpu")
    x, weights, ids = routing(4, dtype=torch.bfloat16)
    w13, w2 = experts(torch.bfloat16)
    got = backend.routed_experts(x, weights, ids, w13, w2)
    assert got.dtype == torch.bfloat16
    want = routed_experts(x.float(), weights, ids, w13.float(), w2.float())
    torch.testing.assert_close(got.float(), want, rtol=0.02, atol=0.02)


# ---- the models ---------------------------------------------------------------------------
@pytest.mark.parametrize("family,layout,tp", [("qwen3_moe", "fused", 1), ("mixtral", "per-expert", 1),
                                               ("qwen3_moe", "per-expert", 2)])
def test_moe_model_through_the_npu_emulator_equals_transformers(saved, npu_op_calls, family, layout, tp):
    """TP 2: expert parallelism, both ranks on the emulator (rank 1's worker installs it as
    rank 0 has), 4 experts a rank; the op counts are rank 0's."""
    folder, theirs = saved(family, layout)
    ref, want = greedy_reference(theirs)
    with LLM(str(folder), kernel_backend="npu", block_size=128, num_blocks=16, tensor_parallel_size=tp,
             enable_expert_parallel=tp > 1) as llm:
        if tp > 1:
            assert [layer.mlp.num_local for layer in llm.engine.model.layers if hasattr(layer.mlp, "num_local")][0] == 4
        torch.testing.assert_close(llm.prompt_logprobs_full(IDS).double(), ref, atol=1e-4, rtol=0)
        out = llm.generate([{"prompt_token_ids": IDS}],
                           SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0].outputs[0]
        assert list(out.token_ids) == want
        assert_no_blocks_in_use(llm.engine)
    assert npu_op_calls["npu_moe_gating_top_k_softmax"] > 0
    assert all(npu_op_calls[op] > 0 for op in MOE_OPS), dict(npu_op_calls)


def test_a_torch_npu_without_the_moe_ops_runs_torch_s_path(npu_emulator, monkeypatch, caplog):
    """An older torch_npu (no npu_moe_* ops): the backend says so once and routes and runs
    the experts with torch's ops, the same results."""
    backend = get_backend("npu", "cpu")
    monkeypatch.setattr(backend, "_moe_missing", ["npu_moe_init_routing_v2"])
    monkeypatch.setattr(backend, "_moe_told", False)
    g = torch.Generator().manual_seed(5)
    x, logits = torch.randn(6, 32, generator=g), torch.randn(6, 8, generator=g)
    w13, w2 = torch.randn(8, 48, 32, generator=g) * 0.2, torch.randn(8, 32, 24, generator=g) * 0.2
    with caplog.at_level("WARNING", logger="pdmesh.kernels"):
        weights, ids = backend.softmax_top_k(logits, 2, True)
        got = backend.routed_experts(x, weights, ids, w13, w2)
        backend.routed_experts(x, weights, ids, w13, w2)
    assert caplog.text.count("lacks ['npu_moe_init_routing_v2']; Mixture-of-Experts layers run torch's ops") == 1
    want_w, want_ids = route(logits, RouterConfig("softmax", 8, 2, renormalize=True))
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_w)
    torch.testing.assert_close(got, routed_experts(x, weights, ids, w13, w2))
