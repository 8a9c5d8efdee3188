"""The emulated MLA ops of torch_npu (kernels/testing/fake_npu_mla.py): npu_kv_rmsnorm_rope_cache
and npu_fused_infer_attention_score's MLA mode against float64 references, each documented
rule refused on its own, and the consequence for our one-plane latent cache: the write goes
through strided views of it, FIA's MLA decode refuses them (kernels/npu_mla.py)."""
from __future__ import annotations

import pytest
import torch

from kernels.api import DecodeMetadata
from kernels.npu_mla import fia_mla_decode
from kernels.ref import RefBackend
from kernels.rope import rope_cos_sin, rope_inv_freq
from kernels.testing import fake_torch_npu as fake
from kernels.testing.fake_npu_mla import npu_kv_rmsnorm_rope_cache as kv_rmsnorm_rope_cache
from kernels.testing.fake_torch_npu import ContractError

R, P, BS, NB = 512, 64, 16, 6
I32 = torch.int32


def _rope(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [1, 1, n, P] (both halves) at positions."""
    cos, sin = rope_cos_sin(rope_inv_freq(P, 10000.0), 64)
    c, s = cos[positions], sin[positions]
    n = positions.numel()
    return torch.cat([c, c], -1).view(1, 1, n, P), torch.cat([s, s], -1).view(1, 1, n, P)


def _write_case(n: int = 5, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(1, 1, n, R + P, generator=g)
    gamma = torch.rand(R, generator=g) + 0.5
    cos, sin = _rope(torch.randint(0, 64, (n,), generator=g))
    slots = torch.randperm(NB * BS, generator=g)[:n]
    return kv, gamma, cos, sin, slots


def _reference(kv, gamma, cos, sin, eps):
    """(y [n, R], k_embed [n, P]) in float64: rms_norm, then DeepSeek's pairs to halves and the
    rotate-half rope."""
    x = kv.double().reshape(-1, R + P)
    c = x[:, :R]
    y = c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + eps) * gamma.double()
    k = torch.cat([x[:, R::2], x[:, R + 1::2]], -1)
    k1, k2 = k[:, :P // 2], k[:, P // 2:]
    cs, sn = cos.double().reshape(-1, P), sin.double().reshape(-1, P)
    return y, k * cs + torch.cat([-k2, k1], -1) * sn


@pytest.mark.parametrize("views", [True, False], ids=["views-of-one-plane", "two-caches"])
def test_kv_rmsnorm_rope_cache_normalizes_rotates_and_scatters(views):
    kv, gamma, cos, sin, slots = _write_case()
    if views:
        plane = torch.zeros(NB, BS, 1, R + P)
        ckv_cache, k_cache = plane[..., :R], plane[..., R:]
    else:
        ckv_cache, k_cache = torch.zeros(NB, BS, 1, R), torch.zeros(NB, BS, 1, P)
    out = kv_rmsnorm_rope_cache(kv, gamma, cos, sin, slots, k_cache, ckv_cache, epsilon=1e-6,
                                cache_mode="PA_BNSD", is_output_kv=True)
    assert out[0] is k_cache and out[1] is ckv_cache
    y, k_embed = _reference(kv, gamma, cos, sin, 1e-6)
    torch.testing.assert_close(out[3].double().reshape(-1, R), y, rtol=0, atol=1e-5)
    torch.testing.assert_close(out[2].double().reshape(-1, P), k_embed, rtol=0, atol=1e-5)
    flat_ckv, flat_k = ckv_cache.reshape(-1, R), k_cache.reshape(-1, P)
    torch.testing.assert_close(flat_ckv[slots].double(), y, rtol=0, atol=1e-5)
    torch.testing.assert_close(flat_k[slots].double(), k_embed, rtol=0, atol=1e-5)
    others = torch.ones(NB * BS, dtype=torch.bool)
    others[slots] = False
    assert not flat_ckv[others].any() and not flat_k[others].any()        # nothing else written
    _, _, k_none, y_none = kv_rmsnorm_rope_cache(kv, gamma, cos, sin, slots, k_cache, ckv_cache, cache_mode="PA")
    assert k_none.numel() == 0 and y_none.numel() == 0                   # is_output_kv False


def _write_args(**change):
    kv, gamma, cos, sin, slots = _write_case()
    args = dict(kv=kv, gamma=gamma, cos=cos, sin=sin, index=slots, k_cache=torch.zeros(NB, BS, 1, P),
                ckv_cache=torch.zeros(NB, BS, 1, R))
    args.update(change)
    kw = {k: args.pop(k) for k in list(args) if k not in ("kv", "gamma", "cos", "sin", "index", "k_cache",
                                                          "ckv_cache")}
    kw.setdefault("cache_mode", "PA_BNSD")
    return lambda: kv_rmsnorm_rope_cache(**args, **kw)


@pytest.mark.parametrize("call, rule", [
    (_write_args(kv=torch.zeros(1, 1, 5, 40)), "hidden_size must be 576"),
    (_write_args(kv=torch.zeros(1, 5, R + P)), r"kv must be 4-D \[batch_size, 1, seq_len"),
    (_write_args(kv=torch.zeros(1, 1, 5, R + P, dtype=I32)), "kv dtype must be one of"),
    (_write_args(gamma=torch.ones(R, dtype=torch.float64)), "gamma dtype must equal kv's"),
    (_write_args(gamma=torch.ones(R + P)), r"gamma must be \[512\]"),
    (_write_args(cos=torch.zeros(5, 1, 1, P)), r"cos must be \[1, 1, 5 or 1, 64\]"),
    (_write_args(index=torch.arange(5, dtype=I32)), "index dtype must be int64"),
    (_write_args(index=torch.arange(4)), r"index must be \[batch_size \* seq_len\] = \[5\]"),
    (_write_args(index=torch.tensor([0, 1, 2, 3, NB * BS])), r"index values must lie in \[0, block_num"),
    (_write_args(index=torch.tensor([0, 1, 2, 3, 3])), "index values must be unique"),
    (_write_args(k_cache=torch.zeros(NB, BS, 1, R), ckv_cache=torch.zeros(NB, BS, 1, P)),
     r"k_cache must be \[block_num, block_size, 1, 64\]"),
    (_write_args(k_cache=torch.zeros(NB, 4, 1, P), ckv_cache=torch.zeros(NB, 4, 1, R)),
     "block_size must be 32-byte aligned"),
    (_write_args(kv=torch.zeros(3, 1, 1, R + P), cos=torch.zeros(3, 1, 1, P), sin=torch.zeros(3, 1, 1, P),
                 index=torch.arange(3), k_cache=torch.zeros(2, BS, 1, P), ckv_cache=torch.zeros(2, BS, 1, R)),
     r"block_num \(2\) must be >= ceil\(seq_len / block_size\) \* batch_size \(3\)"),
    (_write_args(cache_mode="PA_BLK"), "cache_mode must be one of"),
])
def test_kv_rmsnorm_rope_cache_refuses(call, rule):
    with pytest.raises(ContractError, match=rule):
        call()


@pytest.mark.parametrize("change", [dict(cache_mode="PA_NZ"), dict(cache_mode="Norm"),
                                    dict(c_kv_scale=torch.ones(R), k_rope_scale=torch.ones(P))])
def test_kv_rmsnorm_rope_cache_options_not_modeled(change):
    with pytest.raises(NotImplementedError):
        _write_args(**change)()


# ---- npu_fused_infer_attention_score, MLA mode ---------------------------------------------
SEQ_LENS = [37, 1, 20]
HEADS = 8


@pytest.fixture()
def fia(npu_emulator):
    import torch_npu
    return torch_npu.npu_fused_infer_attention_score


def _decode_case(seed: int = 1):
    """A latent plane with 3 requests' rows, their queries [3, HEADS, R + P], block tables."""
    g = torch.Generator().manual_seed(seed)
    plane = torch.randn(NB, BS, 1, R + P, generator=g) * 0.3
    tables = torch.tensor([[4, 1, 3], [0, 0, 0], [5, 2, 0]], dtype=I32)
    query = torch.randn(len(SEQ_LENS), HEADS, R + P, generator=g) * 0.3
    meta = DecodeMetadata(seq_lens=torch.tensor(SEQ_LENS, dtype=I32), block_tables=tables, seq_lens_list=SEQ_LENS)
    return plane, query, meta


def _absorbed(plane, query, meta, scale) -> torch.Tensor:
    """float64 reference: per request softmax(scale * q . row) . row[:R] over its rows."""
    out = []
    for b, kv_len in enumerate(meta.seq_lens_list):
        rows = plane[meta.block_tables[b].long()].reshape(-1, R + P)[:kv_len].double()
        probs = torch.softmax(scale * query[b].double() @ rows.T, -1)
        out.append(probs @ rows[:, :R])
    return torch.stack(out)


def _fia_args(plane, query, meta, layout: str):
    nope, rope = plane[..., :R].contiguous(), plane[..., R:].contiguous()
    seqs = query.shape[0]
    if layout == "BNSD":
        q, qr = query[..., :R].reshape(seqs, HEADS, 1, R), query[..., R:].reshape(seqs, HEADS, 1, P)
        k, kr, extra = nope.view(NB, 1, BS, R), rope.view(NB, 1, BS, P), {}
    elif layout == "BSND":
        q, qr = query[..., :R].reshape(seqs, 1, HEADS, R), query[..., R:].reshape(seqs, 1, HEADS, P)
        k, kr, extra = nope.view(NB, BS, R), rope.view(NB, BS, P), {}
    else:
        q, qr = query[..., :R], query[..., R:]
        k, kr, extra = nope.view(NB, 1, BS, R), rope.view(NB, 1, BS, P), dict(
            actual_seq_lengths=list(range(1, seqs + 1)))
    return (q.contiguous(), k, k), dict(query_rope=qr.contiguous(), key_rope=kr, num_heads=HEADS,
                                        num_key_value_heads=1, input_layout=layout, block_table=meta.block_tables,
                                        block_size=BS, actual_seq_lengths_kv=list(meta.seq_lens_list),
                                        scale=0.05, **extra)


@pytest.mark.parametrize("layout", ["BNSD", "BSND", "TND"])
def test_fia_mla_decode_is_the_absorbed_attention(fia, layout):
    plane, query, meta = _decode_case()
    args, kw = _fia_args(plane, query, meta, layout)
    out, lse = fia(*args, **kw)
    assert out.shape == (*args[0].shape[:-1], R) and lse.shape == (1,)
    torch.testing.assert_close(out.reshape(3, HEADS, R).double(), _absorbed(plane, query, meta, 0.05),
                               rtol=0, atol=1e-5)


def test_fia_mla_tnd_prefill_is_causal_bottom_right(fia):
    plane, query, meta = _decode_case(2)
    q_lens = [3, 1, 2]                      # the last q_len rows of each context
    g = torch.Generator().manual_seed(3)
    query = torch.randn(sum(q_lens), HEADS, R + P, generator=g) * 0.3
    args, kw = _fia_args(plane, query, meta, "TND")
    kw.update(actual_seq_lengths=[3, 4, 6], sparse_mode=3, atten_mask=torch.ones(2048, 2048, dtype=torch.int8).triu(1))
    out, _ = fia(*args, **kw)
    start = 0
    for b, (q_len, kv_len) in enumerate(zip(q_lens, SEQ_LENS)):
        for i in range(q_len):           # query row i sees the first kv_len - q_len + i + 1 rows
            seen = DecodeMetadata(seq_lens=None, block_tables=meta.block_tables[b:b + 1],
                                  seq_lens_list=[kv_len - q_len + i + 1])
            want = _absorbed(plane, query[start + i:start + i + 1], seen, 0.05)
            torch.testing.assert_close(out[start + i].double(), want[0], rtol=0, atol=1e-5)
        start += q_len


def _refused(layout="BNSD", **change):
    plane, query, meta = _decode_case()
    args, kw = _fia_args(plane, query, meta, layout)
    args = list(args)
    for name, value in change.items():
        if name in ("query", "key", "value"):
            args[("query", "key", "value").index(name)] = value(args) if callable(value) else value
        else:
            kw[name] = value(kw) if callable(value) else value
    return args, kw


@pytest.mark.parametrize("args_kw, rule", [
    (_refused(key=lambda a: torch.zeros(NB, BS, 1, R + P)[..., :R].view(NB, 1, BS, R),
              value=lambda a: torch.zeros(NB, BS, 1, R + P)[..., :R].view(NB, 1, BS, R)), "key must be contiguous"),
    (_refused(key_rope=lambda kw: torch.zeros(NB, BS, 1, R + P)[..., R:].view(NB, 1, BS, P)),
     "key_rope must be contiguous"),
    (_refused(key_rope=None), "query_rope and key_rope must be given together"),
    (_refused(query=torch.zeros(3, HEADS, 1, R + P), query_rope=torch.zeros(3, HEADS, 1, P)),
     "MLA query D must be 512 or 128"),
    (_refused(query=torch.zeros(3, 6, 1, R), query_rope=torch.zeros(3, 6, 1, P), num_heads=6),
     "MLA query N must be one of"),
    (_refused(num_heads=4), r"num_heads \(4\) must equal query's N \(8\)"),
    (_refused(num_key_value_heads=0), r"MLA needs one KV head \(num_key_value_heads 1\), got 8"),
    (_refused(query_rope=torch.zeros(3, HEADS, 1, 32)), "query_rope must be query's shape with D 64"),
    (_refused(key_rope=lambda kw: torch.zeros(NB, 1, BS, 32)), "key_rope must be key's shape with D 64"),
    (_refused("BSND", key=lambda a: a[1].view(NB, 1, BS, R), value=lambda a: a[2].view(NB, 1, BS, R)),
     r"MLA key cache must be \[blocks, 16, 512\] in layout BSND"),
    (_refused(softmax_lse_flag=True), "does not support softmax_lse_flag"),
    (_refused(block_size=8), "block_size a multiple of 16"),
    (_refused(sparse_mode=1), "MLA sparse_mode must be 0, 3 or 4"),
    (_refused(block_table=lambda kw: kw["block_table"].long()), "block_table must be int32"),
    (_refused(actual_seq_lengths_kv=[37, 1, 60]), r"request 2: need q_len \(1\) <= kv_len \(60\)"),
    (_refused(scale=1), "scale must be a float"),
])
def test_fia_mla_refuses(fia, args_kw, rule):
    args, kw = args_kw
    with pytest.raises(ContractError, match=rule):
        fia(*args, **kw)


@pytest.mark.parametrize("change", [dict(input_layout="BSH"), dict(sparse_mode=4), dict(antiquant_mode=1),
                                    dict(query=torch.zeros(3, HEADS, 1, 128), query_rope=torch.zeros(3, HEADS, 1, P))])
def test_fia_mla_options_not_modeled(fia, change):
    args, kw = _refused(**change)
    with pytest.raises(NotImplementedError):
        fia(*args, **kw)


# ---- our latent planes ---------------------------------------------------------------------
def test_fia_mla_decode_call_matches_ref_on_two_planes_and_cannot_read_one(npu_emulator):
    """kernels/npu_mla.fia_mla_decode (vLLM-Ascend's call) equals the paged decode over the
    one plane when the nope and rope columns are two contiguous caches; over views of the one
    plane FIA refuses: why the npu backend asks for a split latent cache."""
    import torch_npu
    plane, query, meta = _decode_case(4)
    scale = (R + P) ** -0.5
    want = RefBackend().decode(query, plane, plane, meta, scale)[..., :R]
    got = fia_mla_decode(torch_npu, "scale", query, plane[..., :R].contiguous(), plane[..., R:].contiguous(),
                         meta, scale)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    with pytest.raises(ContractError, match="key must be contiguous"):
        fia_mla_decode(torch_npu, "scale", query, plane[..., :R], plane[..., R:], meta, scale)


def test_the_emulator_registers_the_mla_op():
    if fake.real_torch_npu_importable():
        pytest.skip("a real torch_npu is installed")
    with fake.installed(without=("npu_kv_rmsnorm_rope_cache",)) as module:
        assert not hasattr(module, "npu_kv_rmsnorm_rope_cache")
    with fake.installed() as module:
        assert module.npu_kv_rmsnorm_rope_cache is kv_rmsnorm_rope_cache
