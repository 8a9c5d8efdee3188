"""The emulated quantized-linear ops of torch_npu: each documented rule refused on its own,
and the math (kernels/testing/fake_npu_quant.py)."""
from __future__ import annotations

import pytest
import torch

from kernels.testing.fake_npu_quant import (npu_convert_weight_to_int4pack, npu_dynamic_quant, npu_quant_matmul,
                                            npu_quantize, npu_weight_quant_batchmatmul)
from kernels.testing.fake_torch_npu import ContractError

BF16 = torch.bfloat16


def test_dynamic_quant_multiplies_by_127_over_the_row_max():
    x = torch.tensor([[0.7261, -0.9126, 0.1], [1.0, 0.5, -0.25]], dtype=BF16)
    y, scale = npu_dynamic_quant(x)
    rowmax = x.float().abs().amax(-1)
    assert y.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (2,)
    assert int(y[0, 0]) == 101 and int(y[0, 1]) == -127 and y[1].tolist() == [127, 64, -32]   # 63.5 -> 64 (even)
    assert torch.allclose(scale, rowmax / 127)


@pytest.mark.parametrize("call, rule", [
    (lambda: npu_dynamic_quant(torch.ones(3, 4, dtype=torch.int8)), "input dtype must be float16 or bfloat16"),
    (lambda: npu_dynamic_quant(torch.ones(4, dtype=BF16)), "input must be at least 2-D"),
    (lambda: npu_dynamic_quant(torch.zeros(2, 4, dtype=BF16)), "a row of all zeros"),
    (lambda: npu_dynamic_quant(torch.ones(2, 4, dtype=BF16), smooth_scales=torch.ones(3, dtype=BF16)),
     r"smooth_scales must be torch.bfloat16 \[4\]"),
])
def test_dynamic_quant_refuses(call, rule):
    with pytest.raises(ContractError, match=rule):
        call()


def test_quantize_multiplies_without_div_mode_and_divides_with_it():
    x = torch.tensor([[1.0, -2.0, 300.0]], dtype=BF16)
    s, z = torch.full((3,), 4.0, dtype=BF16), torch.full((3,), 1.0, dtype=BF16)
    assert npu_quantize(x, s, z, torch.qint8, -1, False).tolist() == [[5, -7, 127]]
    assert npu_quantize(x.float(), torch.full((3,), 0.25), None, torch.qint8, 1, True).tolist() == [[4, -8, 127]]


@pytest.mark.parametrize("call, rule", [
    (lambda: npu_quantize(torch.ones(2, 3, dtype=BF16), torch.ones(3), torch.ones(3), torch.qint8, -1, False),
     "scales must be torch.bfloat16"),
    (lambda: npu_quantize(torch.ones(2, 3, dtype=BF16), torch.ones(2, dtype=BF16), None, torch.qint8, -1, False),
     r"scales must be \[3\] or \[1\]"),
    (lambda: npu_quantize(torch.ones(2, 3, dtype=BF16), torch.ones(3, dtype=BF16), None, torch.quint8, -1, False),
     "torch.qint8 only"),
    (lambda: npu_quantize(torch.ones(2, 3), torch.ones(1), None, torch.qint8, 1, True),
     r"scales must be 1-D of len input.size\(1\) = 3"),
])
def test_quantize_refuses(call, rule):
    with pytest.raises(ContractError, match=rule):
        call()


def test_quant_matmul_adds_an_int32_bias_before_scaling_and_a_float_one_after():
    x1 = torch.tensor([[1, 2]], dtype=torch.int8)
    x2 = torch.tensor([[3, 1], [4, -1]], dtype=torch.int8)            # x1 @ x2 = [11, -1]
    scale = torch.tensor([0.5, 2.0])
    got = npu_quant_matmul(x1, x2, scale, bias=torch.tensor([1, 3], dtype=torch.int32), output_dtype=BF16)
    assert got.tolist() == [[6.0, 4.0]]
    got = npu_quant_matmul(x1, x2, scale, pertoken_scale=torch.tensor([2.0]), bias=torch.tensor([1.0, 3.0]),
                           output_dtype=BF16)
    assert got.tolist() == [[12.0, -1.0]]


def test_quant_matmul_keeps_19_bits_of_an_fp32_scale_for_float16_without_pertoken():
    x1, x2 = torch.ones(1, 1, dtype=torch.int8), torch.ones(1, 1, dtype=torch.int8)
    scale = torch.tensor([1.0 + 2 ** -20])             # below the 10 mantissa bits kept
    assert npu_quant_matmul(x1, x2, scale, output_dtype=torch.float16).item() == 1.0
    assert npu_quant_matmul(x1, x2, scale, pertoken_scale=torch.ones(1), output_dtype=torch.float32).item() \
        == pytest.approx(1.0 + 2 ** -20, rel=0, abs=1e-9)


@pytest.mark.parametrize("call, rule", [
    (lambda: npu_quant_matmul(torch.ones(2, 3, dtype=torch.int8), torch.ones(4, 5, dtype=torch.int8), torch.ones(5),
                              output_dtype=BF16), "must share K"),
    (lambda: npu_quant_matmul(torch.ones(1, 65536, dtype=torch.int8), torch.ones(65536, 1, dtype=torch.int8),
                              torch.ones(1), output_dtype=BF16), "must be <= 65535"),
    (lambda: npu_quant_matmul(torch.ones(2, 3, dtype=torch.int8), torch.ones(3, 5, dtype=torch.int8), torch.ones(5)),
     "output_dtype None means int8"),
    (lambda: npu_quant_matmul(torch.ones(2, 3, dtype=torch.int8), torch.ones(3, 5, dtype=torch.int8), torch.ones(4),
                              output_dtype=BF16), r"scale must be \[1\] or \[N = 5\]"),
    (lambda: npu_quant_matmul(torch.ones(2, 3, dtype=torch.int8), torch.ones(3, 5, dtype=torch.int8), torch.ones(5),
                              pertoken_scale=torch.ones(3), output_dtype=BF16), r"pertoken_scale must be float32 \[M = 2\]"),
    (lambda: npu_quant_matmul(torch.ones(2, 3, dtype=torch.int8), torch.ones(3, 5, dtype=torch.int8), torch.ones(5),
                              bias=torch.ones(5, dtype=torch.int64), output_dtype=BF16), "bias dtype must be"),
])
def test_quant_matmul_refuses(call, rule):
    with pytest.raises(ContractError, match=rule):
        call()


def test_weight_quant_batchmatmul_per_group_int4_is_the_dequantized_matmul():
    torch.manual_seed(0)
    codes = torch.randint(-8, 8, (64, 16), dtype=torch.int32)            # [K, N]
    scale = torch.rand(2, 16) + 0.1                                      # groups of 32 inputs
    x = torch.randn(3, 64)
    got = npu_weight_quant_batchmatmul(x, npu_convert_weight_to_int4pack(codes), scale, antiquant_group_size=32)
    want = x @ (codes.float() * scale.repeat_interleave(32, dim=0))
    assert torch.allclose(got, want, atol=1e-4)


@pytest.mark.parametrize("call, rule", [
    (lambda: npu_convert_weight_to_int4pack(torch.full((4, 8), 9, dtype=torch.int32)), r"in \[-8, 7\]"),
    (lambda: npu_convert_weight_to_int4pack(torch.zeros(4, 6, dtype=torch.int32)), "multiple of 8"),
    (lambda: npu_weight_quant_batchmatmul(torch.ones(2, 64), torch.zeros(64, 1, dtype=torch.int32),
                                          torch.ones(4, 8), antiquant_group_size=16), "multiple of 32"),
    (lambda: npu_weight_quant_batchmatmul(torch.ones(2, 64), torch.zeros(64, 1, dtype=torch.int32),
                                          torch.ones(3, 8), antiquant_group_size=32),
     r"\[ceil\(K / G\) = 2, N = 8\]"),
    (lambda: npu_weight_quant_batchmatmul(torch.ones(2, 64, dtype=BF16), torch.zeros(64, 8, dtype=torch.int8),
                                          torch.ones(8)), "antiquant_scale must have x's dtype"),
])
def test_weight_quant_batchmatmul_refuses(call, rule):
    with pytest.raises(ContractError, match=rule):
        call()
