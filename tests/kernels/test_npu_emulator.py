"""The torch_npu emulator: installation, each op's result, and rejection of every
documented contract violation (one at a time, on an otherwise valid call)."""
from __future__ import annotations

import importlib.util
import sys
import types

import pytest
import torch

from kernels.testing import fake_torch_npu as fake
from kernels.testing.fake_torch_npu import ContractError

BS, HEADS, KV_HEADS, DIM = 128, 8, 2, 32
pytestmark = pytest.mark.skipif(fake.real_torch_npu_importable(),
                                reason="a real torch_npu is installed; the emulator stands down")


@pytest.fixture
def npu():
    with fake.installed() as module:
        yield module


def test_install_and_uninstall_restore_sys_modules():
    previous = sys.modules.pop("torch_npu", None)
    try:
        assert fake.install() is True
        mod = sys.modules["torch_npu"]
        assert fake.is_emulated(mod) and importlib.util.find_spec("torch_npu") is not None
        assert fake.install(without=("npu_scatter_pa_kv_cache",)) is True
        assert not hasattr(sys.modules["torch_npu"], "npu_scatter_pa_kv_cache")
        fake.uninstall()
        assert "torch_npu" not in sys.modules
        real = types.ModuleType("torch_npu")
        sys.modules["torch_npu"] = real
        assert fake.install() is False and sys.modules["torch_npu"] is real
        fake.uninstall()
        assert sys.modules["torch_npu"] is real
        with pytest.raises(ValueError, match="unknown ops"):
            sys.modules.pop("torch_npu")
            fake.install(without=("npu_no_such_op",))
        with pytest.raises(ValueError, match="scale_keyword"):
            fake.install(scale_keyword="softmax_scale")
    finally:
        sys.modules.pop("torch_npu", None)
        if previous is not None:
            sys.modules["torch_npu"] = previous


def _fia_case(q_lens=(3, 1), kv_lens=(130, 5), dtype=torch.float32, seed=0):
    """A valid prefill call: (args, kwargs). Two requests in shuffled blocks of 128."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-n // BS) for n in kv_lens]
    perm = torch.randperm(sum(blocks) + 2, generator=gen)
    table = torch.zeros(len(kv_lens), max(blocks) + 1, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks):
        table[i, :n] = perm[used:used + n]
        used += n
    cache_shape = (len(perm), BS, KV_HEADS * DIM)
    query = torch.randn(sum(q_lens), HEADS, DIM, generator=gen).to(dtype)
    key = torch.randn(cache_shape, generator=gen).to(dtype)
    value = torch.randn(cache_shape, generator=gen).to(dtype)
    ends = list(torch.tensor(q_lens).cumsum(0).tolist())
    kwargs = dict(atten_mask=torch.ones(2048, 2048, dtype=torch.int8).triu(1), block_table=table,
                  input_layout="TND", block_size=BS, actual_seq_lengths=ends,
                  actual_seq_lengths_kv=list(kv_lens), num_heads=HEADS,
                  num_key_value_heads=KV_HEADS, sparse_mode=3, scale=0.125)
    return [query, key, value], kwargs


def test_fused_attention_matches_dense_causal_math(npu):
    args, kwargs = _fia_case()
    out, lse = npu.npu_fused_infer_attention_score(*args, softmax_lse_flag=True, **kwargs)
    query, key, value = args
    start = 0
    for b, (end, kv_len) in enumerate(zip(kwargs["actual_seq_lengths"], kwargs["actual_seq_lengths_kv"])):
        blocks = kwargs["block_table"][b, :-(-kv_len // BS)].long()
        k = key[blocks].reshape(-1, KV_HEADS, DIM)[:kv_len].repeat_interleave(4, dim=1)
        v = value[blocks].reshape(-1, KV_HEADS, DIM)[:kv_len].repeat_interleave(4, dim=1)
        q_len = end - start
        scores = torch.einsum("qhd,khd->hqk", query[start:end], k) * 0.125
        visible = torch.arange(kv_len)[None, :] <= torch.arange(q_len)[:, None] + kv_len - q_len
        scores = scores.masked_fill(~visible, float("-inf"))
        torch.testing.assert_close(out[start:end], torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
        torch.testing.assert_close(lse[start:end, :, 0], scores.logsumexp(-1).T)
        start = end


def _noncontiguous(t: torch.Tensor) -> torch.Tensor:
    return torch.cat([t, t], dim=-1)[..., : t.shape[-1]]


FIA_VIOLATIONS = [
    ("block table int64", lambda a, k: k.update(block_table=k["block_table"].long()), "block_table dtype must be int32"),
    ("block table extra row", lambda a, k: k.update(block_table=torch.cat([k["block_table"]] * 2)), "one row per request"),
    ("block table 1-D", lambda a, k: k.update(block_table=k["block_table"][0]), "one row per request"),
    ("non-monotone ends", lambda a, k: k.update(actual_seq_lengths=[3, 2, 4], actual_seq_lengths_kv=[130, 5, 5],
                                                block_table=torch.cat([k["block_table"], k["block_table"][1:]])), "non-decreasing"),
    ("per-request q lens", lambda a, k: k.update(actual_seq_lengths=[3, 1]), "cumulative query ends"),
    ("ends short of T", lambda a, k: k.update(actual_seq_lengths=[1, 3]), "must end at the query's T"),
    ("ends past T", lambda a, k: k.update(actual_seq_lengths=[3, 5]), "must end at the query's T"),
    ("ends as tensor", lambda a, k: k.update(actual_seq_lengths=torch.tensor([3, 4])), "host list of ints"),
    ("kv lens too short", lambda a, k: k.update(actual_seq_lengths_kv=[130]), r"len\(actual_seq_lengths_kv\)"),
    ("kv lens too long", lambda a, k: k.update(actual_seq_lengths_kv=[130, 5, 7]), r"len\(actual_seq_lengths_kv\)"),
    ("kv shorter than q", lambda a, k: k.update(actual_seq_lengths_kv=[2, 5]), r"q_len \(3\) <= kv_len \(2\)"),
    ("kv past table", lambda a, k: k.update(actual_seq_lengths_kv=[130, 1000]), "block_table capacity"),
    ("block id out of range", lambda a, k: k["block_table"].__setitem__((1, 0), 99), "block ids must lie"),
    ("sparse 3 without mask", lambda a, k: k.update(atten_mask=None), "needs atten_mask"),
    ("float mask", lambda a, k: k.update(atten_mask=k["atten_mask"].float()), "bool, int8 or uint8"),
    ("small mask", lambda a, k: k.update(atten_mask=torch.ones(1024, 1024, dtype=torch.int8).triu(1)), "shape"),
    ("lower-triangular mask", lambda a, k: k.update(atten_mask=k["atten_mask"].T.contiguous()), "upper-triangular"),
    ("inverted mask", lambda a, k: k.update(atten_mask=1 - k["atten_mask"]), "upper-triangular"),
    ("non-contiguous query", lambda a, k: a.__setitem__(0, _noncontiguous(a[0])), "query must be contiguous"),
    ("non-contiguous key", lambda a, k: a.__setitem__(1, _noncontiguous(a[1])), "key must be contiguous"),
    ("block size 64", lambda a, k: k.update(block_size=64), "multiple of 128"),
    ("block size 256 vs cache", lambda a, k: k.update(block_size=256), r"key cache \(blocks, block_size, H\)"),
    ("num_heads mismatch", lambda a, k: k.update(num_heads=4), "must equal the N axis"),
    ("kv heads not dividing", lambda a, k: k.update(num_key_value_heads=3), "divisible"),
    ("cache dtype mismatch", lambda a, k: a.__setitem__(1, a[1].half()), "share one dtype"),
    ("BSH layout", lambda a, k: k.update(input_layout="BSH"), None),
    ("sparse mode 2", lambda a, k: k.update(sparse_mode=2), None),
    ("inner_precise 5", lambda a, k: k.update(inner_precise=5), "inner_precise"),
    ("int scale", lambda a, k: k.update(scale=1), "must be a float"),
]


@pytest.mark.parametrize("mutate,match", [v[1:] for v in FIA_VIOLATIONS], ids=[v[0] for v in FIA_VIOLATIONS])
def test_fused_attention_rejects(npu, mutate, match):
    args, kwargs = _fia_case()
    npu.npu_fused_infer_attention_score(*args, **kwargs)
    mutate(args, kwargs)
    with pytest.raises(NotImplementedError if match is None else ContractError, match=match):
        npu.npu_fused_infer_attention_score(*args, **kwargs)


def test_fused_attention_decode_rules(npu):
    args, kwargs = _fia_case(q_lens=(1, 1), kv_lens=(200, 7))
    kwargs.update(sparse_mode=0, atten_mask=None, block_size=BS)
    npu.npu_fused_infer_attention_score(*args, **kwargs)
    with pytest.raises(ContractError, match="0 or 1 when every query length is 1"):
        npu.npu_fused_infer_attention_score(*args, **{**kwargs, "inner_precise": 2})


def test_fused_attention_dtype_head_dim_and_keyword_rules():
    args, kwargs = _fia_case()
    with fake.installed() as npu:
        with pytest.raises(ContractError, match="float32 only on emulated CPU"):
            npu.npu_fused_infer_attention_score(*(t.to("meta") for t in args), **kwargs)
        with pytest.raises(TypeError):
            npu.npu_fused_infer_attention_score(*args, scale_value=kwargs.pop("scale"), **kwargs)
    args, kwargs = _fia_case()
    with fake.installed(scale_keyword="scale_value") as npu:
        out, _ = npu.npu_fused_infer_attention_score(*args, scale_value=kwargs.pop("scale"), **kwargs)
        assert out.shape == args[0].shape
    args, kwargs = _fia_case(dtype=torch.bfloat16)
    with fake.installed(strict_head_dim=True) as npu:
        with pytest.raises(ContractError, match="TND needs D of 128 or 192"):
            npu.npu_fused_infer_attention_score(*args, **kwargs)


def _scatter_case(num_tokens=5, dtype=torch.float32):
    key = torch.randn(num_tokens, KV_HEADS, DIM).to(dtype)
    value = torch.randn(num_tokens, KV_HEADS, DIM).to(dtype)
    k_cache = torch.zeros(3, BS, KV_HEADS, DIM, dtype=dtype)
    slots = torch.tensor([300, 0, 129, 383, 7][:num_tokens])
    return [key, value, k_cache, k_cache.clone(), slots]


def test_scatter_writes_each_token_at_its_slot(npu):
    key, value, k_cache, v_cache, slots = _scatter_case()
    npu.npu_scatter_pa_kv_cache(key, value, k_cache, v_cache, slots.int(), cache_mode="Norm")
    npu._npu_reshape_and_cache(key=key, value=value, key_cache=k_cache, value_cache=v_cache,
                               slot_indices=slots.int())
    for i, slot in enumerate(slots.tolist()):
        assert torch.equal(k_cache[slot // BS, slot % BS], key[i])
        assert torch.equal(v_cache[slot // BS, slot % BS], value[i])
    written = torch.zeros(3 * BS, dtype=torch.bool)
    written[slots] = True
    assert not k_cache.view(3 * BS, -1)[~written].any()


SCATTER_VIOLATIONS = [
    ("default PA_NZ mode", lambda a, k: k.pop("cache_mode"), "cache_mode 'PA_NZ'"),
    ("duplicate slots", lambda a, k: a[4].__setitem__(1, 300), "unique"),
    ("slot -1", lambda a, k: a[4].__setitem__(0, -1), r"must lie in \[0, num_blocks \* block_size = 384\)"),
    ("slot past cache", lambda a, k: a[4].__setitem__(0, 384), "must lie in"),
    ("float slots", lambda a, k: a.__setitem__(4, a[4].float()), "slot mapping dtype"),
    ("slot count", lambda a, k: a.__setitem__(4, a[4][:4]), "one slot per token"),
    ("non-contiguous key", lambda a, k: a.__setitem__(0, _noncontiguous(a[0])), "key must be contiguous"),
    ("non-contiguous cache", lambda a, k: a.__setitem__(2, _noncontiguous(a[2])), "key_cache must be contiguous"),
    ("dtype mismatch", lambda a, k: a.__setitem__(0, a[0].half()), "share one dtype"),
    ("4-D key", lambda a, k: a.__setitem__(0, a[0][None]), "3-D"),
    ("head mismatch", lambda a, k: a.__setitem__(2, a[2][:, :, :1].contiguous()), r"\[num_blocks, block_size, N, D\]"),
]


@pytest.mark.parametrize("mutate,match", [v[1:] for v in SCATTER_VIOLATIONS], ids=[v[0] for v in SCATTER_VIOLATIONS])
def test_scatter_rejects(npu, mutate, match):
    args, kwargs = _scatter_case(), {"cache_mode": "Norm"}
    mutate(args, kwargs)
    with pytest.raises(ContractError, match=match):
        npu.npu_scatter_pa_kv_cache(*args, **kwargs)


def test_reshape_and_cache_needs_int32_slots(npu):
    with pytest.raises(ContractError, match="int32"):
        npu._npu_reshape_and_cache(*_scatter_case())


def test_rms_norm_and_rotary_math_and_rules(npu):
    x = torch.randn(6, HEADS, DIM)
    gamma = torch.randn(DIM)
    y, rstd = npu.npu_rms_norm(x, gamma, epsilon=1e-5)
    torch.testing.assert_close(y, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * gamma)
    assert rstd.shape == (6, HEADS, 1) and rstd.dtype == torch.float32
    with pytest.raises(ContractError, match="gamma dtype"):
        npu.npu_rms_norm(x, gamma.double())
    with pytest.raises(ContractError, match="last dims"):
        npu.npu_rms_norm(x, gamma[:16])

    angles = torch.rand(6, 1, DIM // 2) * 6
    cos, sin = angles.cos().repeat(1, 1, 2), angles.sin().repeat(1, 1, 2)
    x1, x2 = x.chunk(2, dim=-1)
    expected = torch.cat((x1 * cos[..., :16] - x2 * sin[..., :16], x2 * cos[..., :16] + x1 * sin[..., :16]), -1)
    torch.testing.assert_close(npu.npu_rotary_mul(x, cos, sin), expected)
    pairs = npu.npu_rotary_mul(x, cos, sin, rotary_mode="interleave")
    torch.testing.assert_close(pairs[..., 1], x[..., 1] * cos[..., 1] + x[..., 0] * sin[..., 1])
    for bad, match in [((x, cos * 2, sin), r"\[-1, 1\]"), ((x, cos.double(), sin.double()), "input's dtype"),
                       ((x, cos[0], sin[0]), "3-D or all be 4-D"), ((x[..., :31], cos[..., :31], sin[..., :31]), "even")]:
        with pytest.raises(ContractError, match=match):
            npu.npu_rotary_mul(*bad)
