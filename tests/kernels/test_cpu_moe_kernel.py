"""The cpu backend's MoE experts (kernels/cpu.py routed_experts): a decode step's few rows an
expert through the C++ kernel (kernels/csrc/moe_cpu.cpp), more rows through torch's GEMMs,
both against the torch reference (kernels/moe.py) and float64; expert-parallel shares; every
dtype; what the kernel refuses."""
from __future__ import annotations

import pytest
import torch

from kernels.cpu import FEW_ROWS, CpuBackend
from kernels.moe import routed_experts

EXPERTS, HIDDEN, INTER, TOP_K = 8, 96, 80, 2
CLOSE = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=3e-2, rtol=2e-2),
         torch.float16: dict(atol=4e-3, rtol=4e-3)}


@pytest.fixture(scope="module")
def backend(cpu_extension_backend) -> CpuBackend:
    return cpu_extension_backend


class Counting:
    """The extension with its MoE kernel's calls counted (the path under test ran)."""

    def __init__(self, extension):
        self.extension, self.calls = extension, 0

    def moe_experts_few_rows(self, *args):
        self.calls += 1
        return self.extension.moe_experts_few_rows(*args)

    def __getattr__(self, name):         # the extension's other ops, as they are
        return getattr(self.extension, name)


def case(tokens: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(tokens)])
    weights = torch.rand(tokens, TOP_K, generator=g)
    w13 = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) / HIDDEN ** 0.5).to(dtype)
    w2 = (torch.randn(EXPERTS, HIDDEN, INTER, generator=g) / INTER ** 0.5).to(dtype)
    return x, weights, ids, w13, w2


def float64(x, weights, ids, w13, w2, first_expert=0):
    return routed_experts(x.double(), weights.double(), ids, w13.double(), w2.double(), first_expert)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens,kernel", [(1, True), (16, True), (200, False)])
def test_experts_match_torch_and_float64(backend, monkeypatch, dtype, tokens, kernel):
    x, weights, ids, w13, w2 = case(tokens, dtype)
    counting = Counting(backend.extension)
    monkeypatch.setattr(backend, "extension", counting)
    w13p, w2p = backend.prepare_experts(w13, w2)
    assert w13p is w13 or torch.equal(w13p, w13)       # kept as is for the kernel (no oneDNN packing)
    got = backend.routed_experts(x, weights, ids, w13p, w2p)
    rows_per_expert = torch.bincount(ids.reshape(-1), minlength=EXPERTS)
    assert counting.calls == (1 if kernel else 0) and (rows_per_expert.max() <= FEW_ROWS) == kernel
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, routed_experts(x, weights, ids, w13, w2), **CLOSE[dtype])
    torch.testing.assert_close(got.double(), float64(x, weights, ids, w13, w2), **CLOSE[dtype])


def test_expert_parallel_shares_sum_to_the_whole(backend):
    x, weights, ids, w13, w2 = case(12, torch.float32, seed=3)
    shares = [backend.routed_experts(x, weights, ids, w13[r * 4:(r + 1) * 4].contiguous(),
                                     w2[r * 4:(r + 1) * 4].contiguous(), first_expert=r * 4) for r in (0, 1)]
    whole = float64(x, weights, ids, w13, w2)
    torch.testing.assert_close((shares[0] + shares[1]).double(), whole, **CLOSE[torch.float32])
    for rank, holds in ((0, ids < 4), (1, ids >= 4)):     # a rank's share: nothing for tokens none of its experts took
        none_here = ~holds.any(dim=1)
        assert none_here.any() and shares[rank][none_here].abs().max() == 0


def test_the_kernel_refuses_what_it_cannot_compute(backend):
    x, _, _, w13, w2 = case(4, torch.float32)
    kernel = backend.extension.moe_experts_few_rows
    with pytest.raises(RuntimeError, match="counts must sum to the rows"):
        kernel(x, w13, w2, [1] * EXPERTS)
    with pytest.raises(RuntimeError, match="counts must have one entry per expert"):
        kernel(x, w13, w2, [4])
    with pytest.raises(RuntimeError, match="rows, w13 and w2 must share a dtype"):
        kernel(x.double(), w13, w2, [4] + [0] * (EXPERTS - 1))
    with pytest.raises(RuntimeError, match=r"shapes: rows \[P, H\], w13 \[E, 2I, H\], w2 \[E, H, I\]"):
        kernel(x, w13, w2.transpose(1, 2).contiguous(), [4] + [0] * (EXPERTS - 1))
