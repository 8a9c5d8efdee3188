"""The cpu backend's C++ layer ops (kernels/csrc/layer_ops_cpu.cpp) against ref's torch ops
and float64: RMSNorm with and without the residual add, SiLU-and-multiply, rotary in place
on the strided views a fused qkv matmul gives, the KV write (slots of -1 skipped); every
dtype; batches on one thread and spread over threads; what each refuses."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import rope_cos_sin, rope_inv_freq
from kernels.cpu import CpuBackend
from kernels.ref import RefBackend

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# float32: summation order only; 16-bit: one rounding of the output either side
CLOSE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=8e-3),
         torch.float16: dict(atol=2e-3, rtol=1e-3)}
ROWS = [1, 3, 40]     # 40 rows: several tasks of the op's 16-row grain


@pytest.fixture(scope="module")
def backend(cpu_extension_backend) -> CpuBackend:
    return cpu_extension_backend


def _randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).mul(2).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_rms_norm_matches_ref_and_float64(backend, dtype, rows):
    x, weight = _randn(rows, 96, dtype=dtype), _randn(96, dtype=dtype, seed=1)
    out = backend.rms_norm(x, weight, 1e-5)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out, RefBackend().rms_norm(x, weight, 1e-5), **CLOSE[dtype])
    xd = x.double()
    expected = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.double()
    torch.testing.assert_close(out.double(), expected, **CLOSE[dtype])


def test_rms_norm_of_a_row_view_and_of_three_dims(backend):
    wide = _randn(5, 200)
    weight = _randn(64, seed=1)
    view = wide[:, 10:74]                 # rows strided 200 apart
    torch.testing.assert_close(backend.rms_norm(view, weight, 1e-6), RefBackend().rms_norm(view, weight, 1e-6))
    heads = _randn(4, 3, 64)             # Qwen3's per-head q/k norm
    torch.testing.assert_close(backend.rms_norm(heads, weight, 1e-6), RefBackend().rms_norm(heads, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_add_rms_norm_leaves_the_sum_in_the_residual(backend, dtype, rows):
    x, residual = _randn(rows, 96, dtype=dtype), _randn(rows, 96, dtype=dtype, seed=2)
    weight = _randn(96, dtype=dtype, seed=1)
    ref_residual = residual.clone()
    expected = RefBackend().add_rms_norm(x, ref_residual, weight, 1e-6)
    out = backend.add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(residual, ref_residual)          # the add rounds once, as torch's
    torch.testing.assert_close(out, expected, **CLOSE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_silu_and_mul_matches_torch(backend, dtype, rows):
    x = _randn(rows, 2 * 80, dtype=dtype)
    gate, up = x.chunk(2, dim=-1)
    out = backend.silu_and_mul(x)
    assert out.shape == (rows, 80) and out.dtype == dtype
    torch.testing.assert_close(out, F.silu(gate) * up, **CLOSE[dtype])
    expected = F.silu(gate.double()) * up.double()
    torch.testing.assert_close(out.double(), expected, **CLOSE[dtype])


def test_silu_and_mul_refuses_an_odd_width(backend):
    with pytest.raises(RuntimeError, match="even number of features"):
        backend.silu_and_mul(torch.zeros(2, 7))


def _qkv(tokens, heads, kv_heads, head_dim, dtype, seed=0):
    """q, k, v as the fused qkv matmul gives them: strided views of one [tokens, width] row."""
    qkv = _randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=seed)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim), v.reshape(tokens, kv_heads, head_dim)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", ROWS)
def test_rotary_in_place_on_qkv_views_matches_ref(backend, dtype, tokens):
    cos, sin = rope_cos_sin(rope_inv_freq(64, 1e5), 4096)
    q, k, _ = _qkv(tokens, 9, 3, 64, dtype)
    positions = torch.randint(0, 4096, (tokens,), generator=torch.Generator().manual_seed(tokens))
    expected_q, expected_k = RefBackend().rotary(positions, q.clone(), k.clone(), cos, sin)
    out_q, out_k = backend.rotary(positions, q, k, cos, sin)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()   # in place
    torch.testing.assert_close(out_q, expected_q, **CLOSE[dtype])
    torch.testing.assert_close(out_k, expected_k, **CLOSE[dtype])


def test_rotary_refuses_a_position_past_the_tables(backend):
    cos, sin = rope_cos_sin(rope_inv_freq(64, 1e4), 128)
    q, k, _ = _qkv(2, 4, 2, 64, torch.float32)
    before = q.clone()
    with pytest.raises(RuntimeError, match="position 128 is outside the rotary tables' 128 positions"):
        backend.rotary(torch.tensor([5, 128]), q, k, cos, sin)
    assert torch.equal(q, before)


def _caches(num_blocks, block_size, kv_heads, head_dim, dtype):
    """One layer's caches as the model passes them: views into [layers, 2, blocks, ...]."""
    whole = torch.zeros(2, 2, num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    return whole, whole[1, 0], whole[1, 1]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 5, 90])
def test_write_kv_matches_ref_and_skips_minus_one(backend, dtype, tokens):
    _, k, v = _qkv(tokens, 9, 3, 64, dtype, seed=tokens)
    slots = torch.randperm(8 * 16, generator=torch.Generator().manual_seed(tokens))[:tokens]
    slots[tokens // 2] = -1
    ours, k_cache, v_cache = _caches(8, 16, 3, 64, dtype)
    theirs, ref_k, ref_v = _caches(8, 16, 3, 64, dtype)
    backend.write_kv(k, v, k_cache, v_cache, slots)
    RefBackend().write_kv(k, v, ref_k, ref_v, slots)
    assert torch.equal(ours, theirs)
    assert ours[0].abs().sum() == 0            # the other layer untouched
    written = (k_cache.reshape(8 * 16, -1) != 0).any(dim=1)
    assert written.sum() == tokens - 1 and torch.equal(written.nonzero().flatten(), slots[slots >= 0].sort().values)


def test_write_kv_refuses_a_slot_outside_the_cache_and_writes_nothing(backend):
    _, k, v = _qkv(3, 4, 2, 32, torch.float32)
    whole, k_cache, v_cache = _caches(4, 16, 2, 32, torch.float32)
    with pytest.raises(RuntimeError, match="slot 64 outside the cache's 64 slots"):
        backend.write_kv(k, v, k_cache, v_cache, torch.tensor([0, 1, 64]))
    assert whole.abs().sum() == 0


def test_decode_takes_the_scale_and_strided_queries(backend):
    """The model hands decode the rotated query view of the qkv row and the scale; the
    kernel scales it as ref's `query.float() * scale` does."""
    from tests.kernels.paged_case import make_paged
    paged = make_paged([1] * 3, [40, 3, 70], block_size=16, num_heads=8, num_kv_heads=2, seed=4)
    backend.write_kv(paged.key, paged.value, paged.k_cache, paged.v_cache, paged.slot_mapping)
    wide = torch.zeros(3, 8 * 32 + 100)
    wide[:, :256] = paged.query.reshape(3, 256)
    strided = wide[:, :256].view(3, 8, 32)
    assert not strided.is_contiguous()
    meta = paged.decode_meta()
    out = backend.decode(strided, paged.k_cache, paged.v_cache, meta, 0.125)
    expected = RefBackend().decode(paged.query, paged.k_cache, paged.v_cache, meta, 0.125)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
