"""The emulated Mixture-of-Experts ops of torch_npu (kernels/testing/fake_npu_moe.py): hand-made
cases with exact outcomes, float64 math, and each documented rule refused on its own."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.testing.fake_npu_moe import (npu_grouped_matmul, npu_moe_finalize_routing, npu_moe_gating_top_k,
                                          npu_moe_gating_top_k_softmax, npu_moe_init_routing, npu_moe_init_routing_v2,
                                          npu_swiglu)
from kernels.testing.fake_torch_npu import ContractError

I32, I64 = torch.int32, torch.int64


# ---- npu_moe_gating_top_k_softmax ----------------------------------------------------------
def test_gating_top_k_softmax_picks_the_largest_probabilities_and_numbers_pairs_by_column():
    x = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.5, -1.0, 0.0, 4.0], [2.0, 2.5, -3.0, 1.0]])
    y, idx, row_idx = npu_moe_gating_top_k_softmax(x, None, k=2)
    assert idx.dtype == I32 and row_idx.dtype == I32 and y.dtype == torch.float32
    assert idx.tolist() == [[1, 2], [3, 0], [1, 0]]
    assert row_idx.tolist() == [[0, 3], [1, 4], [2, 5]]
    probs = torch.softmax(x.double(), -1)
    torch.testing.assert_close(y.double(), probs.gather(1, idx.long()), rtol=0, atol=1e-7)


@pytest.mark.parametrize("call, rule", [
    (lambda: npu_moe_gating_top_k_softmax(torch.zeros(3, 4), k=5), r"k must be an int in \(0, min\(x.size\(-1\) = 4"),
    (lambda: npu_moe_gating_top_k_softmax(torch.zeros(3, 4), k=0), "k must be an int"),
    (lambda: npu_moe_gating_top_k_softmax(torch.zeros(3, 4, dtype=I32), k=1), "x dtype must be float16"),
    (lambda: npu_moe_gating_top_k_softmax(torch.zeros(4), k=1), "x must be 2-D or 3-D"),
])
def test_gating_top_k_softmax_refuses(call, rule):
    with pytest.raises(ContractError, match=rule):
        call()


# ---- npu_moe_gating_top_k ------------------------------------------------------------------
def test_gating_top_k_keeps_the_best_groups_then_the_best_experts_of_them():
    # 2 tokens, 9 experts in 3 groups of 3; sigmoid scores chosen through logit(p)
    p = torch.tensor([[0.9, 0.1, 0.1, 0.6, 0.55, 0.1, 0.8, 0.2, 0.1],
                      [0.4, 0.3, 0.3, 0.1, 0.2, 0.3, 0.95, 0.05, 0.05]], dtype=torch.float64)
    x = torch.log(p / (1 - p)).float()
    bias = torch.tensor([0.0] * 8 + [0.4])
    y, idx, norm = npu_moe_gating_top_k(x, 2, bias=bias, k_group=2, group_count=3, group_select_mode=1, norm_type=1,
                                        out_flag=True, routed_scaling_factor=2.0)
    # token 0: group top-2 sums 1.0, 1.15, 1.3 (expert 8 biased to 0.5) -> groups 1, 2; best 0.8 (6), 0.6 (3)
    # token 1: sums 0.7, 0.5, 1.4 -> groups 0, 2; best 0.95 (6), then expert 8 at 0.05 + 0.4 beats 0.4 (0);
    # its weight is its unbiased 0.05
    assert idx.dtype == I32 and idx.tolist() == [[6, 3], [6, 8]]
    want = p.gather(1, idx.long())
    want = want / want.sum(-1, keepdim=True) * 2
    torch.testing.assert_close(y.double(), want, rtol=0, atol=1e-6)
    torch.testing.assert_close(norm.double(), p, rtol=0, atol=1e-6)
    # by max instead: token 0's groups score 0.9, 0.6, 0.8 -> groups 0, 2
    _, idx, _ = npu_moe_gating_top_k(x, 2, k_group=2, group_count=3, group_select_mode=0, norm_type=1)
    assert idx[0].tolist() == [0, 6]


@pytest.mark.parametrize("kw, rule", [
    (dict(group_count=4), "group_count must divide the 8 experts into groups of more than 2"),
    (dict(group_count=2, k_group=3), r"k_group must be in \[1, group_count = 2\]"),
    (dict(group_count=2, k_group=1, k=5), r"k must be in \[1, E / group_count \* k_group = 4\]"),
    (dict(renorm=1), "renorm must be 0"),
    (dict(bias=torch.zeros(8, dtype=torch.float16)), "bias must be \\[8\\] of x's dtype"),
])
def test_gating_top_k_refuses(kw, rule):
    args = {"k": 2, **kw}
    with pytest.raises(ContractError, match=rule):
        npu_moe_gating_top_k(torch.zeros(3, 8), args.pop("k"), **args)


# ---- npu_moe_init_routing (v1) -------------------------------------------------------------
def test_init_routing_v1_sorts_column_numbered_pairs_by_expert():
    x = torch.tensor([[0.1] * 4, [0.2] * 4, [0.3] * 4])
    row_idx = torch.tensor([[0, 3], [1, 4], [2, 5]], dtype=I32)
    expert_idx = torch.tensor([[1, 2], [0, 1], [0, 2]], dtype=I32)
    expanded_x, expanded_row_idx, expanded_expert_idx = npu_moe_init_routing(x, row_idx, expert_idx, 3)
    # by expert, stable: pairs (t, j) (1, 0) (2, 0) | (0, 0) (1, 1) | (0, 1) (2, 1); row = j * 3 + t
    assert expanded_expert_idx.tolist() == [0, 0, 1, 1, 2, 2]
    assert expanded_row_idx.tolist() == [2, 0, 1, 4, 3, 5]
    assert torch.equal(expanded_x, x[[1, 2, 0, 1, 0, 2]])


def test_init_routing_v1_refuses_row_idx_that_is_no_numbering():
    with pytest.raises(ContractError, match="row_idx must number the NUM_ROWS"):
        npu_moe_init_routing(torch.zeros(2, 4), torch.zeros(2, 2, dtype=I32), torch.zeros(2, 2, dtype=I32), 2)


# ---- npu_moe_init_routing_v2 ---------------------------------------------------------------
X = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
IDX = torch.tensor([[3, 1], [0, 3]], dtype=I32)     # pairs (token-major) 0:3 1:1 2:0 3:3


def v2(row_idx_type=0, expert_tokens_num_type=1, **kw):
    args = dict(active_num=4, expert_num=4, expert_tokens_num_type=expert_tokens_num_type,
                expert_tokens_num_flag=True, quant_mode=-1, active_expert_range=[1, 4], row_idx_type=row_idx_type)
    return npu_moe_init_routing_v2(X, IDX, **{**args, **kw})


def test_init_routing_v2_puts_the_range_s_pairs_first_by_expert():
    expanded_x, row_idx, counts, _ = v2()
    assert row_idx.dtype == I32 and counts.dtype == I64
    assert row_idx.tolist() == [1, 0, -1, 2]                  # pair -> position; pair 2 (expert 0) outside
    assert expanded_x.shape == (4, 2)
    assert expanded_x[:3].tolist() == [[1.0, 2.0], [1.0, 2.0], [3.0, 4.0]]    # pairs 1, 0, 3
    assert bool(expanded_x[3].isnan().all())                 # past the 3 valid rows: undefined
    assert counts.tolist() == [1, 0, 2]                       # experts 1, 2, 3


def test_init_routing_v2_scatter_index_and_count_forms():
    _, scatter, cumsum, _ = v2(row_idx_type=1, expert_tokens_num_type=0)
    assert scatter[:3].tolist() == [1, 0, 3] and cumsum.tolist() == [1, 1, 3]
    _, _, pairs, _ = v2(expert_tokens_num_type=2)
    assert pairs.tolist() == [[1, 1], [3, 2], [0, 0], [0, 0]]
    expanded_x, row_idx, counts, _ = v2(active_expert_range=[])       # default: every expert
    assert row_idx.tolist() == [2, 1, 0, 3] and counts.tolist() == [1, 1, 0, 2]
    assert expanded_x.tolist() == [[3.0, 4.0], [1.0, 2.0], [1.0, 2.0], [3.0, 4.0]]


@pytest.mark.parametrize("kw, rule", [
    (dict(expert_num=3, active_expert_range=[1, 3]), r"every expert id must lie in \[0, expert_num = 3\)"),
    (dict(active_expert_range=[2, 5]), r"0 <= expert_start < expert_end <= expert_num \(4\)"),
    (dict(active_expert_range=[2, 2]), "expert_start < expert_end"),
    (dict(active_num=-1), "active_num must be an int >= 0"),
    (dict(expert_num=10241), r"expert_num must be in \[0, 10240\]"),
    (dict(row_idx_type=2), "row_idx_type must be 0"),
    (dict(expert_tokens_num_type=3), "expert_tokens_num_type must be 0"),
])
def test_init_routing_v2_refuses(kw, rule):
    with pytest.raises(ContractError, match=rule):
        v2(**kw)


def test_init_routing_v2_refuses_int64_ids_and_leaves_quantization_unmodeled():
    with pytest.raises(ContractError, match="expert_idx dtype must be int32, got torch.int64"):
        npu_moe_init_routing_v2(X, IDX.long(), expert_num=4)
    with pytest.raises(NotImplementedError, match="unquantized"):
        v2(quant_mode=1)


# ---- npu_grouped_matmul --------------------------------------------------------------------
def gmm_case():
    g = torch.Generator().manual_seed(0)
    return torch.randn(5, 3, generator=g), torch.randn(2, 4, 3, generator=g)     # x [M, K], w [E, N, K]


@pytest.mark.parametrize("group_list_type, group_list", [(1, [2, 3]), (0, [2, 5])])
def test_grouped_matmul_multiplies_each_group_of_rows_by_its_weight(group_list_type, group_list):
    x, w_nk = gmm_case()
    want = torch.cat([x[:2].double() @ w_nk[0].double().t(), x[2:].double() @ w_nk[1].double().t()])
    for weight in (w_nk.transpose(1, 2), w_nk.transpose(1, 2).contiguous()):        # transposed view, plain [E, K, N]
        (y,) = npu_grouped_matmul([x], [weight], group_list=torch.tensor(group_list), split_item=2, group_type=0,
                                  group_list_type=group_list_type)
        assert y.shape == (5, 4) and y.dtype == x.dtype
        torch.testing.assert_close(y.double(), want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("change, rule", [
    (dict(group_list=torch.tensor([2, 2])), r"the sizes must sum to x's first dim \(5\), got 4"),
    (dict(group_list=torch.tensor([2, 3], dtype=I32)), "group_list must be 1-D int64"),
    (dict(group_list=torch.tensor([5])), r"one entry per group of weight \(E = 2\), got 1"),
    (dict(group_list=torch.tensor([3, 2]), group_list_type=0), "non-negative and non-decreasing"),
    (dict(group_list=torch.tensor([2, 4]), group_list_type=0), r"the last value must equal x's first dim \(5\)"),
    (dict(split_item=0), "need split_item 2 or 3"),
    (dict(group_list_type=2), "group_list_type must be 0"),
    (dict(output_dtype=torch.float16), "output_dtype must be None or x's dtype"),
])
def test_grouped_matmul_refuses(change, rule):
    x, w_nk = gmm_case()
    args = dict(group_list=torch.tensor([2, 3]), split_item=2, group_type=0, group_list_type=1)
    with pytest.raises(ContractError, match=rule):
        npu_grouped_matmul([x], [w_nk.transpose(1, 2)], **{**args, **change})


def test_grouped_matmul_refuses_layouts_and_dtypes_it_does_not_take():
    x, w_nk = gmm_case()
    args = dict(group_list=torch.tensor([2, 3]), split_item=2, group_type=0, group_list_type=1)
    with pytest.raises(ContractError, match="weight must be contiguous or transposed"):
        npu_grouped_matmul([x], [torch.randn(2, 3, 8)[:, :, ::2]], **args)
    with pytest.raises(ContractError, match="x must be contiguous"):
        npu_grouped_matmul([torch.randn(3, 5).t()], [w_nk.transpose(1, 2)], **args)
    with pytest.raises(ContractError, match="weight dtype must equal x dtype"):
        npu_grouped_matmul([x], [w_nk.transpose(1, 2).half()], **args)
    with pytest.raises(ContractError, match=r"must share K \(3\)"):
        npu_grouped_matmul([x], [w_nk], **args)


# ---- npu_swiglu ----------------------------------------------------------------------------
def test_swiglu_gates_the_second_half_by_silu_of_the_first():
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(npu_swiglu(x).double(), (F.silu(x[:, :4].double()) * x[:, 4:].double()),
                               rtol=0, atol=1e-6)
    with pytest.raises(ContractError, match="size along dim -1 must be even, got 7"):
        npu_swiglu(torch.zeros(3, 7))
    with pytest.raises(ContractError, match="input must be contiguous"):
        npu_swiglu(torch.zeros(8, 3).t())


# ---- npu_moe_finalize_routing --------------------------------------------------------------
ROWS = torch.arange(12, dtype=torch.float32).view(4, 3)           # NUM_ROWS = 2, K = 2, H = 3
SCALES = torch.tensor([[0.5, 0.25], [1.0, 2.0]])


def test_finalize_routing_sums_the_scaled_rows_of_each_source_row_by_either_index_order():
    want = torch.stack([1 + 0.5 * ROWS[3] + 0.25 * ROWS[0], 1 + ROWS[1] + 2 * ROWS[2]])
    row_major = torch.tensor([3, 0, 1, 2], dtype=I32)             # [i * K + k]
    col_major = torch.tensor([3, 1, 0, 2], dtype=I32)             # [k * NUM_ROWS + i]
    skip1 = torch.ones(2, 3)
    assert torch.equal(npu_moe_finalize_routing(ROWS, skip1, None, None, SCALES, row_major, None, drop_pad_mode=2),
                       want)
    assert torch.equal(npu_moe_finalize_routing(ROWS, skip1, None, None, SCALES, col_major, None), want)
    bias = torch.tensor([[100.0] * 3, [0.0] * 3])
    experts = torch.tensor([[0, 1], [1, 1]], dtype=I32)
    with_bias = npu_moe_finalize_routing(ROWS, skip1, None, bias, SCALES, row_major, experts, drop_pad_mode=2)
    assert torch.equal(with_bias, want + torch.tensor([[50.0] * 3, [0.0] * 3]))


@pytest.mark.parametrize("args, rule", [
    ((ROWS, None, None, None, SCALES, torch.tensor([3, 0, -1, 2], dtype=I32), None),
     r"values must lie in \[0, NUM_ROWS \* K - 1 = 3\]"),
    ((ROWS, None, None, None, SCALES, torch.tensor([3, 0, 1, 2]), None), "must be 1-D int32"),
    ((ROWS, None, None, None, SCALES.half(), torch.tensor([3, 0, 1, 2], dtype=I32), None),
     "scales dtype must equal expanded_permuted_rows'"),
    ((ROWS, None, torch.ones(2, 3), None, SCALES, torch.tensor([3, 0, 1, 2], dtype=I32), None), "skip2 needs skip1"),
    ((ROWS, torch.ones(3, 3), None, None, SCALES, torch.tensor([3, 0, 1, 2], dtype=I32), None),
     r"skip1 must be \[2, 3\]"),
    ((ROWS[:3], None, None, None, SCALES, torch.tensor([3, 0, 1, 2], dtype=I32), None), "must have NUM_ROWS \\* K = 4"),
    ((ROWS, None, None, torch.zeros(2, 3), SCALES, torch.tensor([3, 0, 1, 2], dtype=I32), None),
     "bias needs expert_for_source_row"),
])
def test_finalize_routing_refuses(args, rule):
    with pytest.raises(ContractError, match=rule):
        npu_moe_finalize_routing(*args)


def test_finalize_routing_leaves_drop_pad_unmodeled():
    with pytest.raises(NotImplementedError, match="dropless routing only"):
        npu_moe_finalize_routing(ROWS, None, None, None, SCALES, torch.tensor([3, 0, 1, 2], dtype=I32), None, 1)
