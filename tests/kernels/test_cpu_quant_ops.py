"""The cpu backend's C++ W8A8 halves (kernels/csrc/quant_ops_cpu.cpp) against the torch
reference (kernels/api.py): per-token and per-tensor quantization code for code (round half
to even, an all-zero row, every dtype, rows over threads), the int32 accumulator back to
floats with every combination of scales and biases, the AVX512-VNNI GEMV of a decode
step's rows (kernels/csrc/int8_gemv_cpu.cpp) exact, and what each refuses."""
from __future__ import annotations

import pytest
import torch

from kernels.api import Backend
from kernels.cpu import CpuBackend
from kernels.ref import RefBackend

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module")
def backend(cpu_extension_backend) -> CpuBackend:
    return cpu_extension_backend


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 40])
@pytest.mark.parametrize("divisor", [127.0, 127.5])
def test_quantize_per_token_equals_the_reference_code_for_code(backend, dtype, rows, divisor):
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 200, generator=g) * 3).to(dtype)
    x[0, 7] = 40.0            # an outlier channel
    if rows > 2:
        x[2] = 0              # an all-zero row: scale 1, codes 0
    want_q, want_s = Backend.quantize_per_token(RefBackend(), x, divisor)
    q, s = backend.quantize_per_token(x, divisor)
    assert q.dtype == torch.int8 and s.shape == (rows, 1) and s.dtype == torch.float32
    assert torch.equal(s, want_s) and torch.equal(q, want_q)


def test_quantize_rounds_half_to_even(backend):
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, 126.5]])      # scale 1 at divisor 127
    q, s = backend.quantize_per_token(x, 127.0)
    assert float(s) == 1.0 and q.tolist() == [[127, 0, 2, 2, 0, -2, 126]]


@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("row_scale, int_bias, bias", [(False, False, False), (True, False, True),
                                                       (False, True, False), (True, True, True)])
def test_int8_scaled_matmul_equals_the_reference(backend, out_dtype, row_scale, int_bias, bias):
    g = torch.Generator().manual_seed(1)
    x_q = torch.randint(-128, 128, (5, 64), dtype=torch.int8, generator=g)
    w = torch.randint(-128, 128, (48, 64), dtype=torch.int8, generator=g)
    scale = torch.rand(1, 48, generator=g) * 1e-3
    kwargs = dict(row_scale=torch.rand(5, 1, generator=g) if row_scale else None,
                  int_bias=torch.randint(-5000, 5000, (48,), dtype=torch.int32, generator=g) if int_bias else None,
                  bias=torch.randn(48, generator=g) if bias else None, out_dtype=out_dtype)
    want = Backend.int8_scaled_matmul(RefBackend(), x_q, w, scale, **kwargs)
    got = backend.int8_scaled_matmul(x_q, backend.prepare_int8_weight(w), scale, **kwargs)
    assert got.dtype == out_dtype
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-6)     # one float rounding at most (fused multiply-add)


def test_the_ops_refuse_what_they_cannot_read(backend):
    ext = backend.extension
    with pytest.raises(RuntimeError, match="divisor must be > 0"):
        ext.quantize_per_token(torch.ones(2, 4), 0.0)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        ext.quantize_per_token(torch.ones(4, 2).t(), 127.0)
    acc = torch.zeros(2, 3, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="one value per output"):
        ext.dequant_rows(acc, torch.ones(4))
    with pytest.raises(RuntimeError, match="one value per row"):
        ext.dequant_rows(acc, torch.ones(3), torch.ones(3, 1))
    with pytest.raises(RuntimeError, match="int32 matrix"):
        ext.dequant_rows(acc.float(), torch.ones(3))


def vnni(backend) -> bool:
    return backend.extension.int8_gemv_supported()


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("k, n", [(576, 960), (1536, 576), (64, 1), (65, 7), (100, 33), (1, 5), (4096, 130)])
def test_int8_gemv_is_exact(backend, rows, k, n):
    """Every row count it takes, inputs a multiple of 64 and not (the masked tail), extreme
    codes (-128 x -128 everywhere would overflow nothing: 4096 * 2^14 < 2^31)."""
    if not vnni(backend):
        pytest.skip("this CPU has no AVX512-VNNI")
    g = torch.Generator().manual_seed(rows * 7919 + k)
    x = torch.randint(-128, 128, (rows, k), dtype=torch.int8, generator=g)
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    x[0, 0], w[0, 0] = -128, -128
    want = (x.double() @ w.double().t()).to(torch.int32)
    assert torch.equal(backend.extension.int8_gemv(x, w), want)
    for a, b in ((-128, -128), (127, -128), (-128, 127)):    # 127 shifts to 255: the largest products
        assert torch.equal(backend.extension.int8_gemv(torch.full((rows, k), a, dtype=torch.int8),
                                                       torch.full((n, k), b, dtype=torch.int8)),
                           torch.full((rows, n), a * b * k, dtype=torch.int32))


@pytest.mark.parametrize("rows, k, prepared, gemv", [(1, 192, True, True), (4, 192, True, True),
                                                     (5, 192, True, False), (0, 192, True, False),
                                                     (2, 4104, True, False), (2, 192, False, False)])
def test_the_backend_takes_the_gemv_for_a_decode_steps_rows_only(backend, monkeypatch, rows, k, prepared, gemv):
    """Up to 4 rows of at most 4096 inputs against a prepared weight on int8_gemv
    (torch._int_mm not called); more rows or inputs, or another weight layout, on oneDNN;
    equal either way."""
    if not vnni(backend):
        pytest.skip("this CPU has no AVX512-VNNI")
    calls = []
    real = torch._int_mm
    monkeypatch.setattr(torch, "_int_mm", lambda a, b: calls.append(a.shape) or real(a, b))
    g = torch.Generator().manual_seed(rows)
    x = torch.randint(-128, 128, (rows, k), dtype=torch.int8, generator=g)
    w = torch.randint(-128, 128, (48, k), dtype=torch.int8, generator=g)
    weight = backend.prepare_int8_weight(w) if prepared else w.t().contiguous()   # [in, out] contiguous
    got = backend.int8_matmul(x, weight)
    assert torch.equal(got, (x.double() @ w.double().t()).to(torch.int32))
    assert (calls == []) == gemv
    assert "AVX512-VNNI GEMV" in backend.int8_path


@pytest.mark.parametrize("rows", [1, 3, 40])
def test_quantize_per_tensor_equals_the_reference_code_for_code(backend, rows):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 200, generator=g) * 3
    x[0, :6] = torch.tensor([-3.5, -2.5, 0.5, 1.5, 1000.0, -1000.0]) * 0.25   # ties at scale 0.25, and clamps
    for scale, offset in ((0.25, 0.0), (0.05, -3.0), (0.013, 7.0)):
        want = Backend.quantize_per_tensor(RefBackend(), x, scale, offset)
        assert torch.equal(backend.quantize_per_tensor(x, scale, offset), want), (scale, offset)
    assert backend.quantize_per_tensor(x, 0.25, 0.0)[0, :6].tolist() == [-4, -2, 0, 2, 127, -128]


def test_quantize_per_tensor_divides_as_the_reference_at_step_boundaries(backend):
    """Inputs one float32 step either side of (j + 0.5) * scale, where x / s and x * (1 / s)
    round apart: the C++ pass divides, as ATen's CPU division by a scalar does."""
    scale = 0.013
    mid = (torch.arange(-120, 120, dtype=torch.float64) + 0.5) * scale
    x = torch.cat([torch.nextafter(mid.float(), torch.tensor(float("inf"))),
                   torch.nextafter(mid.float(), torch.tensor(float("-inf"))), mid.float()]).reshape(3, -1)
    reciprocal = torch.round(x * (1 / scale)).clamp(-128, 127).to(torch.int8)
    want = Backend.quantize_per_tensor(RefBackend(), x, scale, 0.0)
    assert not torch.equal(reciprocal, want)      # the inputs do tell the two apart
    assert torch.equal(backend.quantize_per_tensor(x, scale, 0.0), want)


def test_the_gemv_and_static_quantizer_refuse_what_they_cannot_read(backend):
    ext = backend.extension
    with pytest.raises(RuntimeError, match="scale must be > 0"):
        ext.quantize_per_tensor(torch.ones(2, 4), 0.0, 0.0)
    with pytest.raises(RuntimeError, match="float32 CPU matrix"):
        ext.quantize_per_tensor(torch.ones(2, 4, dtype=torch.float64), 1.0, 0.0)
    if not vnni(backend):
        return
    x, w = torch.zeros(5, 64, dtype=torch.int8), torch.zeros(3, 64, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="1 to 4 rows, got 5"):
        ext.int8_gemv(x, w)
    with pytest.raises(RuntimeError, match="weight has 32 inputs, x_q 64"):
        ext.int8_gemv(x[:1], torch.zeros(3, 32, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="contiguous CPU int8 matrix \\[out, in\\]"):
        ext.int8_gemv(x[:1], torch.zeros(64, 3, dtype=torch.int8).t())
