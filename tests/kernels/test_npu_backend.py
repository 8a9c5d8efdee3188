"""NpuBackend through the torch_npu emulator against the ref backend: random runner-like
steps (decode tokens then prefill chunks: fresh, prefix hit, continuing chunk), GQA 4:1,
shuffled block ids, padded last blocks, block size 128."""
from __future__ import annotations

import random
import subprocess
import sys
import types

import pytest
import torch

from kernels.api import DecodeMetadata, PrefillMetadata
from kernels.ref import RefBackend
from kernels.testing import fake_torch_npu as fake

BS, HEADS, KV_HEADS, DIM = 128, 8, 2, 32
SCALE = DIM ** -0.5
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _backend(**options):
    from kernels.npu import NpuBackend
    if fake.real_torch_npu_importable():
        pytest.skip("a real torch_npu is installed; these tests run on the emulator")
    with fake.installed(**options):
        return NpuBackend(device="cpu")


def _step(seed: int, dtype=torch.float32) -> dict:
    """Caches holding every request's earlier tokens, plus the step's new tokens packed as
    [one per decode request | prefill chunks], with slot mapping and both metadata."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    decode_lens = [rng.choice([1, BS, BS + 1, rng.randint(2, 400)]) for _ in range(rng.randint(1, 4))]
    prefill = []
    for _ in range(rng.randint(1, 4)):
        cached = rng.choice([0, BS, 2 * BS, rng.randint(1, 300)])
        prefill.append((rng.randint(1, 200), cached))
    seq_lens = decode_lens + [q + c for q, c in prefill]
    q_lens = [1] * len(decode_lens) + [q for q, _ in prefill]
    num_blocks = sum(-(-n // BS) for n in seq_lens) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    shape = (num_blocks, BS, KV_HEADS, DIM)
    k_cache, v_cache = torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype)
    tables, slots = [], []
    for q_len, seq_len in zip(q_lens, seq_lens):
        table = [perm.pop() for _ in range(-(-seq_len // BS))]
        tables.append(table)
        slots += [table[p // BS] * BS + p % BS for p in range(seq_len - q_len, seq_len)]
    width = max(map(len, tables)) + 1
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    nd = len(decode_lens)
    total = sum(q_lens)
    ends = torch.tensor([0] + q_lens[nd:]).cumsum(0).to(torch.int32)
    return dict(
        k_cache=k_cache, v_cache=v_cache, slot_mapping=torch.tensor(slots),
        query=torch.randn(total, HEADS, DIM, generator=gen).to(dtype),
        key=torch.randn(total, KV_HEADS, DIM, generator=gen).to(dtype),
        value=torch.randn(total, KV_HEADS, DIM, generator=gen).to(dtype), num_decode=nd,
        decode=DecodeMetadata(torch.tensor(decode_lens, dtype=torch.int32), block_tables[:nd], decode_lens),
        prefill=PrefillMetadata(ends, torch.tensor(seq_lens[nd:], dtype=torch.int32), block_tables[nd:],
                                q_lens[nd:], seq_lens[nd:]))


def _run(backend, step) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    k_cache, v_cache, nd = step["k_cache"].clone(), step["v_cache"].clone(), step["num_decode"]
    q, k, v = step["query"], step["key"], step["value"]
    backend.write_kv(k, v, k_cache, v_cache, step["slot_mapping"])
    out = torch.cat([backend.decode(q[:nd], k_cache, v_cache, step["decode"], SCALE),
                     backend.prefill(q[nd:], k[nd:], v[nd:], k_cache, v_cache, step["prefill"], SCALE)])
    return out, k_cache, v_cache


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_step_matches_ref(seed, dtype):
    step = _step(seed, dtype)
    out, k_cache, v_cache = _run(_backend(), step)
    ref_out, ref_k, ref_v = _run(RefBackend(), step)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    torch.testing.assert_close(out, ref_out, **TOL[dtype])


def test_older_torch_npu_fallbacks_match_ref():
    """_npu_reshape_and_cache instead of npu_scatter_pa_kv_cache; scale_value keyword."""
    backend = _backend(without=("npu_scatter_pa_kv_cache",), scale_keyword="scale_value")
    assert backend._scatter is None and backend._scale_kw == "scale_value"
    step = _step(7)
    out, k_cache, _ = _run(backend, step)
    ref_out, ref_k, _ = _run(RefBackend(), step)
    assert torch.equal(k_cache, ref_k)
    torch.testing.assert_close(out, ref_out, **TOL[torch.float32])


def test_write_kv_skips_minus_one_slots_like_ref():
    backend, step = _backend(), _step(3)
    slots = step["slot_mapping"].clone()
    slots[::3] = -1
    got = (step["k_cache"].clone(), step["v_cache"].clone())
    want = (step["k_cache"].clone(), step["v_cache"].clone())
    backend.write_kv(step["key"], step["value"], *got, slots)
    RefBackend().write_kv(step["key"], step["value"], *want, slots)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    backend.write_kv(step["key"], step["value"], *got, torch.full_like(slots, -1))


def test_rms_norm_and_rotary_match_ref():
    from kernels.rope import rope_cos_sin, rope_inv_freq
    backend, ref = _backend(), RefBackend()
    cos, sin = rope_cos_sin(rope_inv_freq(DIM, 10000.0, None), 512)
    positions = torch.tensor([0, 5, 511, 130, 7])
    q, k = torch.randn(5, HEADS, DIM), torch.randn(5, KV_HEADS, DIM)
    for got, want in zip(backend.rotary(positions, q, k, cos, sin), ref.rotary(positions, q, k, cos, sin)):
        torch.testing.assert_close(got, want)
    x, w = torch.randn(5, 64), torch.randn(64)
    torch.testing.assert_close(backend.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6))
    torch.testing.assert_close(backend.rms_norm(q, w[:DIM], 1e-6), ref.rms_norm(q, w[:DIM], 1e-6))


def test_block_size_rule():
    backend, step = _backend(), _step(1)
    assert backend.supported_block_sizes() == [128]
    small = step["k_cache"].view(-1, 64, KV_HEADS, DIM)
    with pytest.raises(ValueError, match="block_size 128"):
        backend.decode(step["query"][:1], small, small, step["decode"], SCALE)


def test_prefill_mask_is_cached_int8_upper_triangular():
    backend, step = _backend(), _step(2)
    _run(backend, step)
    _run(backend, step)
    (mask,) = backend._masks.values()
    assert mask.dtype == torch.int8 and mask.shape == (2048, 2048)
    assert torch.equal(mask, torch.ones(2048, 2048, dtype=torch.int8).triu(1))


def test_construction_without_torch_npu_is_a_clear_error(monkeypatch):
    from kernels.npu import NpuBackend
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    with pytest.raises(RuntimeError, match="needs torch_npu .*fake_torch_npu.install"):
        NpuBackend()
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    with pytest.raises(RuntimeError, match="lacks"):
        NpuBackend()


class _Schema:
    def __init__(self, *names):
        self.arguments = [types.SimpleNamespace(name=n) for n in names]


class _Packet:
    """Looks like torch.ops.npu.<op>: no Python signature, one schema per overload."""

    def __init__(self, *names):
        self.default = types.SimpleNamespace(_schema=_Schema("query", *names))

    def __call__(self, *args, **kwargs):
        raise AssertionError

    def overloads(self):
        return ["default"]


def test_scale_keyword_shim():
    from kernels.npu import scale_keyword

    def new_style(query, key, value, *, num_heads=1, scale=1.0): ...
    def old_style(query, key, value, *, num_heads=1, scale_value=1.0): ...
    builtin = types.SimpleNamespace(__doc__="npu_fused_infer_attention_score(Tensor query, *, "
                                            "int num_heads=1, float scale_value=1.0) -> (Tensor, Tensor)")
    assert scale_keyword(new_style) == "scale" and scale_keyword(old_style) == "scale_value"
    assert scale_keyword(_Packet("num_heads", "scale_value")) == "scale_value"
    assert scale_keyword(_Packet("scale", "num_heads")) == "scale"
    assert scale_keyword(builtin) == "scale_value"


def test_importing_kernel_modules_loads_no_vendor_package():
    code = ("import sys, kernels, kernels.npu, kernels.cuda, kernels.factory;"
            "bad = [m for m in ('torch_npu', 'flash_attn', 'vllm_flash_attn') if m in sys.modules];"
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(_root()))


def _root():
    from pathlib import Path
    return Path(__file__).resolve().parents[2]
