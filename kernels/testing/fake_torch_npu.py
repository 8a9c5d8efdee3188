"""An emulated `torch_npu` for machines without an Ascend NPU.

`install()` puts a module named `torch_npu` into sys.modules (only where no real torch_npu
is importable), so `kernels.npu.NpuBackend` runs on CPU tensors. Each emulated op first
checks the argument contract documented for torch_npu (Ascend Extension for PyTorch 7.x)
and raises `ContractError` (a ValueError) naming the violated rule, then computes the
result with plain torch in float32. Ops and the contracts enforced:

  npu_scatter_pa_kv_cache   3-D key/value [T, N, D]; ND caches [blocks, block_size, N, D]
                            need cache_mode="Norm"; one dtype for all four; slot_mapping
                            int32/int64 [T], unique, in [0, blocks * block_size); contiguous.
  _npu_reshape_and_cache    the same with slot_indices int32 only (older torch_npu).
                            (both: kernels/testing/fake_npu_kv_write.py)
  npu_fused_infer_attention_score
                            input_layout "TND" with page attention only: query [T, N, D]
                            float16/bfloat16; key/value caches [blocks, block_size, H] or
                            [blocks, KV_N, block_size, D]; block_table int32 [B, >= max
                            blocks]; actual_seq_lengths = cumulative query ends (host ints,
                            non-decreasing, last == T, B = its length); actual_seq_lengths_kv
                            = per-request KV lengths, len == B, q_len <= kv_len <= table
                            capacity; block_size a multiple of 128 in [128, 512] when a
                            query is longer than 1 token (else a multiple of 16 <= 512);
                            num_heads == N, num_heads % num_key_value_heads == 0, ratio <= 64;
                            D % 16 == 0 (D == 128 with strict_head_dim); sparse_mode 3
                            needs the (2048, 2048) upper-triangular bool/int8/uint8 mask,
                            sparse_mode 0 takes no mask (no masking); contiguous tensors.
  npu_rms_norm              -> (y, rstd); gamma in x's dtype, shaped like x's last dims.
  npu_rotary_mul            3-D/4-D input, r1/r2 of the same rank and dtype in [-1, 1],
                            rotary_mode "half" (rotate-half) or "interleave".
  quantized linears         npu_dynamic_quant, npu_quantize, npu_quant_matmul,
                            npu_convert_weight_to_int4pack, npu_weight_quant_batchmatmul:
                            kernels/testing/fake_npu_quant.py.
  int8 (C8) KV cache        npu_fused_infer_attention_score with key/value antiquant
                            scales, decode only (BSH, S = 1): kernels/testing/fake_npu_kv_int8.py.
  Mixture of Experts        npu_moe_gating_top_k(_softmax), npu_moe_init_routing(_v2),
                            npu_grouped_matmul, npu_swiglu, npu_moe_finalize_routing:
                            kernels/testing/fake_npu_moe.py.
  Multi-head Latent Attention
                            npu_kv_rmsnorm_rope_cache, and npu_fused_infer_attention_score
                            with query_rope / key_rope: kernels/testing/fake_npu_mla.py.

One relaxation: float32 query/key/value are accepted on CPU tensors (the engine's float32
tests); on any other device the op's float16/bfloat16 rule applies.
"""
from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import inspect
import sys
import types
from collections.abc import Sequence

import torch

MASK_SIZE = 2048
_FIA_KEYWORDS = (
    "pse_shift", "atten_mask", "actual_seq_lengths", "actual_seq_lengths_kv", "dequant_scale1",
    "quant_scale1", "dequant_scale2", "quant_scale2", "quant_offset2", "antiquant_scale",
    "antiquant_offset", "block_table", "query_padding_size", "kv_padding_size",
    "key_antiquant_scale", "key_antiquant_offset", "value_antiquant_scale",
    "value_antiquant_offset", "key_shared_prefix", "value_shared_prefix",
    "actual_shared_prefix_len", "query_rope", "key_rope", "key_rope_antiquant_scale",
    "num_heads", "SCALE", "pre_tokens", "next_tokens", "input_layout", "num_key_value_heads",
    "sparse_mode", "inner_precise", "block_size", "antiquant_mode", "softmax_lse_flag",
    "key_antiquant_mode", "value_antiquant_mode")
_FIA_DEFAULTS = dict(num_heads=1, pre_tokens=2147483647, next_tokens=2147483647,
                     input_layout="BSH", num_key_value_heads=0, sparse_mode=0, inner_precise=0,
                     block_size=0, antiquant_mode=0, softmax_lse_flag=False,
                     key_antiquant_mode=0, value_antiquant_mode=0)
_MODELED = {"atten_mask", "actual_seq_lengths", "actual_seq_lengths_kv", "block_table",
            "num_heads", "pre_tokens", "next_tokens", "input_layout", "num_key_value_heads",
            "sparse_mode", "inner_precise", "block_size", "softmax_lse_flag"}
_HALF = (torch.float16, torch.bfloat16)
_VERIFIED_MASK: list[torch.Tensor | None] = [None]


class ContractError(ValueError):
    """An argument breaks the documented contract of an emulated torch_npu op."""


def _require(ok: bool, op: str, rule: str) -> None:
    if not ok:
        raise ContractError(f"torch_npu.{op}: {rule}")


def _check_float(op: str, name: str, t: torch.Tensor, allowed=_HALF) -> None:
    ok = t.dtype in allowed or (t.dtype == torch.float32 and t.device.type == "cpu")
    _require(ok, op, f"{name} dtype must be one of {[str(d) for d in allowed]} "
                     f"(float32 only on emulated CPU tensors), got {t.dtype}")


def _check_contiguous(op: str, **tensors: torch.Tensor | None) -> None:
    for name, t in tensors.items():
        _require(t is None or t.is_contiguous(), op, f"{name} must be contiguous (non-contiguous "
                                                     "tensors are not supported)")


def _host_ints(op: str, name: str, values) -> list[int]:
    _require(isinstance(values, Sequence) and not isinstance(values, str)
             and all(isinstance(v, int) for v in values), op,
             f"{name} must be a host list of ints, got {type(values).__name__}")
    return list(values)


def _check_mask(op: str, mask: torch.Tensor | None) -> None:
    _require(mask is not None, op, f"sparse_mode=3 needs atten_mask, the ({MASK_SIZE}, {MASK_SIZE}) "
                                   "upper-triangular mask")
    _require(mask.dtype in (torch.bool, torch.int8, torch.uint8), op,
             f"atten_mask dtype must be bool, int8 or uint8, got {mask.dtype}")
    _require(tuple(mask.shape[-2:]) == (MASK_SIZE, MASK_SIZE) and mask.dim() in (2, 3, 4)
             and mask.numel() == MASK_SIZE * MASK_SIZE, op,
             f"sparse_mode=3 needs atten_mask of shape ({MASK_SIZE}, {MASK_SIZE}), (1, ...) or "
             f"(1, 1, ...), got {tuple(mask.shape)}")
    _check_contiguous(op, atten_mask=mask)
    if _VERIFIED_MASK[0] is mask:
        return
    want = torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.bool, device=mask.device).triu(1)
    _require(torch.equal(mask.reshape(MASK_SIZE, MASK_SIZE).bool(), want), op,
             "atten_mask must be strictly upper-triangular ones (1 = masked), lower triangle and "
             "diagonal zero")
    _VERIFIED_MASK[0] = mask


def paged_attention_math(query, key_cache, value_cache, block_table, q_lens, kv_lens, scale,
                         causal, with_lse=False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Reference paged attention in float32: query [T, N, D] packed by q_lens, caches
    [blocks, block_size, KV_N, D]; causal is bottom-right aligned. Returns (out in query's
    dtype, logsumexp [T, N, 1] float32 when with_lse else None)."""
    num_tokens, num_heads, head_dim = query.shape
    kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    out = torch.empty(num_tokens, num_heads, value_cache.shape[-1], dtype=query.dtype, device=query.device)
    lse = torch.empty(num_tokens, num_heads, 1, device=query.device) if with_lse else None
    start = 0
    for b, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
        rows = slice(start, start + q_len)
        start += q_len
        blocks = block_table[b, :-(-kv_len // block_size)].long()
        k = key_cache[blocks].flatten(0, 1)[:kv_len].float()
        v = value_cache[blocks].flatten(0, 1)[:kv_len].float()
        q = query[rows].float().view(q_len, kv_heads, num_heads // kv_heads, head_dim)
        scores = torch.einsum("qkgd,skd->kgqs", q, k) * scale
        if causal:
            allowed = torch.ones(q_len, kv_len, dtype=torch.bool, device=q.device).tril(kv_len - q_len)
            scores.masked_fill_(~allowed, float("-inf"))
        if with_lse:
            lse[rows] = scores.logsumexp(-1).flatten(0, 1).T.unsqueeze(-1)
        o = torch.einsum("kgqs,skd->qkgd", scores.softmax(-1), v)
        out[rows] = o.reshape(q_len, num_heads, -1).to(query.dtype)
    return out, lse


def _fia_lengths(op: str, args: dict, num_tokens: int) -> tuple[list[int], list[int]]:
    """(q_lens, kv_lens) from actual_seq_lengths (cumulative) and actual_seq_lengths_kv."""
    q_ends = _host_ints(op, "actual_seq_lengths", args["actual_seq_lengths"])
    kv_lens = _host_ints(op, "actual_seq_lengths_kv", args["actual_seq_lengths_kv"])
    batch = len(q_ends)
    _require(0 < batch <= 4096, op, f"actual_seq_lengths must hold 1..4096 entries, got {batch}")
    _require(all(b >= a for a, b in zip([0] + q_ends, q_ends)), op,
             f"actual_seq_lengths must be cumulative query ends, non-decreasing from >= 0, got {q_ends}")
    _require(q_ends[-1] == num_tokens, op,
             f"actual_seq_lengths must end at the query's T ({num_tokens}), got {q_ends[-1]}")
    _require(len(kv_lens) == batch, op,
             f"len(actual_seq_lengths_kv) ({len(kv_lens)}) must equal the batch size B ({batch})")
    return [b - a for a, b in zip([0] + q_ends, q_ends)], kv_lens


def _fia_pages(op: str, args: dict, key, value, q_lens, kv_lens, kv_heads: int, head_dim: int):
    """Checks block_table, block_size and the paged caches; returns the caches viewed as
    [blocks, block_size, KV_N, D]."""
    table, block_size = args["block_table"], args["block_size"]
    _require(table.dtype == torch.int32, op, f"block_table dtype must be int32, got {table.dtype}")
    _require(table.dim() == 2 and table.shape[0] == len(q_lens), op,
             f"block_table must be 2-D with one row per request (B = {len(q_lens)}), got {tuple(table.shape)}")
    if max(q_lens) > 1:
        _require(block_size % 128 == 0 and 128 <= block_size <= 512, op,
                 f"page attention with query length > 1 needs block_size a multiple of 128 in [128, 512], "
                 f"got {block_size}")
    else:
        _require(block_size % 16 == 0 and 16 <= block_size <= 512, op,
                 f"page attention needs block_size a multiple of 16 <= 512, got {block_size}")
    if key.dim() == 3:
        _require(key.shape[1] == block_size and key.shape[2] == kv_heads * head_dim, op,
                 f"key cache (blocks, block_size, H) must be (*, {block_size}, {kv_heads * head_dim}), "
                 f"got {tuple(key.shape)}")
        caches = tuple(t.view(t.shape[0], block_size, kv_heads, head_dim) for t in (key, value))
    else:
        _require(key.dim() == 4 and tuple(key.shape[1:]) == (kv_heads, block_size, head_dim), op,
                 f"key cache (blocks, KV_N, block_size, D) must be (*, {kv_heads}, {block_size}, "
                 f"{head_dim}), got {tuple(key.shape)}")
        caches = tuple(t.transpose(1, 2) for t in (key, value))
    _require(key.shape == value.shape, op, "key and value caches must have the same shape")
    capacity = table.shape[1] * block_size
    for b, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
        _require(q_len <= kv_len <= capacity, op, f"request {b}: need q_len ({q_len}) <= kv_len "
                                                  f"({kv_len}) <= block_table capacity ({capacity})")
        ids = table[b, :-(-kv_len // block_size)]
        _require(bool(((ids >= 0) & (ids < key.shape[0])).all()), op,
                 f"request {b}: block ids must lie in [0, {key.shape[0]}), got {ids.tolist()}")
    return caches


def _fused_infer_attention_score(query, key, value, *, _strict_head_dim, _scale_keyword, **kw):
    op = "npu_fused_infer_attention_score"
    args = {**dict.fromkeys(_FIA_KEYWORDS), **_FIA_DEFAULTS, **kw}
    scale = kw.get(_scale_keyword, 1.0)
    int8_kv = torch.int8 in (key.dtype, value.dtype)
    mla = kw.get("query_rope") is not None or kw.get("key_rope") is not None
    modeled = _MODELED
    if mla:
        from kernels.testing.fake_npu_mla import MODELED as MLA
        modeled = _MODELED | MLA
    elif int8_kv:
        from kernels.testing.fake_npu_kv_int8 import MODELED as ANTIQUANT, antiquant_decode
        modeled = _MODELED | ANTIQUANT
    for name, val in kw.items():
        if name not in modeled and name != _scale_keyword and val not in (None, _FIA_DEFAULTS.get(name)):
            raise NotImplementedError(f"{op}: the emulator does not model {name}")
    if mla:
        from kernels.testing.fake_npu_mla import mla_attention
        return mla_attention(query, key, value, args, scale, _scale_keyword)
    if int8_kv:
        _require(isinstance(scale, float), op, f"{_scale_keyword} must be a float, got {type(scale).__name__}")
        return antiquant_decode(query, key, value, args, scale)
    if args["input_layout"] != "TND" or args["block_table"] is None:
        raise NotImplementedError(f"{op}: the emulator models input_layout='TND' with page attention only")
    _require(query.dim() == 3, op, f"TND query must be 3-D [T, N, D], got {tuple(query.shape)}")
    _check_float(op, "query", query)
    _require(key.dtype == query.dtype == value.dtype, op, "query, key and value must share one dtype")
    _check_contiguous(op, query=query, key=key, value=value, block_table=args["block_table"])
    num_tokens, num_heads, head_dim = query.shape
    kv_heads = args["num_key_value_heads"] or args["num_heads"]
    _require(args["num_heads"] == num_heads, op,
             f"num_heads ({args['num_heads']}) must equal the N axis of query ({num_heads})")
    _require(num_heads % kv_heads == 0 and num_heads // kv_heads <= 64, op,
             f"num_heads ({num_heads}) must be divisible by num_key_value_heads ({kv_heads}), ratio <= 64")
    _require(head_dim % 16 == 0 and head_dim <= 512, op, f"D must be a multiple of 16 <= 512, got {head_dim}")
    _require(not _strict_head_dim or head_dim in (128, 192), op, f"TND needs D of 128 or 192, got {head_dim}")
    q_lens, kv_lens = _fia_lengths(op, args, num_tokens)
    k_cache, v_cache = _fia_pages(op, args, key, value, q_lens, kv_lens, kv_heads, head_dim)
    mode = args["sparse_mode"]
    if mode == 3:
        _check_mask(op, args["atten_mask"])
    elif mode != 0 or args["atten_mask"] is not None:
        raise NotImplementedError(f"{op}: the emulator models sparse_mode 3 and sparse_mode 0 "
                                  f"without a mask only, got sparse_mode={mode}")
    _require(args["inner_precise"] in ((0, 1, 2, 3) if max(q_lens) > 1 else (0, 1)), op,
             f"inner_precise must be 0..3 (0 or 1 when every query length is 1), got {args['inner_precise']}")
    _require(isinstance(scale, float), op, f"{_scale_keyword} must be a float, got {type(scale).__name__}")
    out, lse = paged_attention_math(query, k_cache, v_cache, args["block_table"], q_lens, kv_lens,
                                    scale, causal=mode == 3, with_lse=args["softmax_lse_flag"])
    return out, (lse if lse is not None else torch.zeros(1, device=query.device))


def npu_rms_norm(x, gamma, epsilon=1e-6):
    """-> (x * rsqrt(mean(x^2 over gamma's dims) + epsilon) * gamma in x's dtype, rstd fp32)."""
    op = "npu_rms_norm"
    _check_float(op, "x", x, (torch.float16, torch.bfloat16, torch.float32))
    _require(gamma.dtype == x.dtype, op, f"gamma dtype must equal x dtype ({x.dtype}), got {gamma.dtype}")
    _require(0 < gamma.dim() <= x.dim() and x.shape[x.dim() - gamma.dim():] == gamma.shape, op,
             f"gamma shape {tuple(gamma.shape)} must match the last dims of x {tuple(x.shape)}")
    dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(dim=dims, keepdim=True) + epsilon)
    return (xf * rstd * gamma.float()).to(x.dtype), rstd


def npu_rotary_mul(input, r1, r2, rotary_mode="half", rotate=None):  # noqa: A002 (torch_npu name)
    """x * r1 + rotate(x) * r2, rotate-half ("half") or pairwise ("interleave")."""
    op = "npu_rotary_mul"
    if rotate is not None:
        raise NotImplementedError(f"{op}: the emulator does not model rotate")
    _require(rotary_mode in ("half", "interleave"), op, f"rotary_mode must be 'half' or 'interleave', got {rotary_mode!r}")
    _require(input.dim() in (3, 4) and r1.dim() == r2.dim() == input.dim(), op,
             "input, r1 and r2 must all be 3-D or all be 4-D")
    _check_float(op, "input", input, (torch.float16, torch.bfloat16, torch.float32))
    _require(r1.dtype == r2.dtype == input.dtype, op, "r1 and r2 must have input's dtype")
    d = input.shape[-1]
    _require(d % 2 == 0 and d < 896, op, f"D must be even and < 896, got {d}")
    _require(r1.shape == r2.shape and r1.shape[-1] == d, op, "r1 and r2 must share a shape ending in D")
    _require(all(a in (1, b) for a, b in zip(r1.shape, input.shape)), op,
             f"r1/r2 {tuple(r1.shape)} must broadcast to input {tuple(input.shape)}")
    _require(bool(r1.abs().le(1).all() and r2.abs().le(1).all()), op, "r1 and r2 must lie in [-1, 1]")
    x = input.float()
    if rotary_mode == "half":
        x1, x2 = x.chunk(2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
    else:
        rotated = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    return (x * r1.float() + rotated * r2.float()).to(input.dtype)


def _make_fia(scale_keyword: str, strict_head_dim: bool):
    def npu_fused_infer_attention_score(query, key, value, **kwargs):
        """Emulated torch_npu.npu_fused_infer_attention_score -> (attention_out, softmax_lse)."""
        sig.bind(query, key, value, **kwargs)
        return _fused_infer_attention_score(query, key, value, _strict_head_dim=strict_head_dim,
                                            _scale_keyword=scale_keyword, **kwargs)

    kw_only = inspect.Parameter.KEYWORD_ONLY
    params = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in ("query", "key", "value")]
    params += [inspect.Parameter(scale_keyword if n == "SCALE" else n, kw_only,
                                 default=1.0 if n == "SCALE" else _FIA_DEFAULTS.get(n))
               for n in _FIA_KEYWORDS]
    sig = inspect.Signature(params)
    npu_fused_infer_attention_score.__signature__ = sig
    return npu_fused_infer_attention_score


def is_emulated(module: types.ModuleType | None) -> bool:
    return bool(getattr(module, "_pdmesh_emulator", False))


def real_torch_npu_importable() -> bool:
    """Whether `import torch_npu` would give a real (not emulated) torch_npu."""
    current = sys.modules.get("torch_npu")
    if current is not None:
        return not is_emulated(current)
    return "torch_npu" not in sys.modules and importlib.util.find_spec("torch_npu") is not None


def install(*, without: tuple[str, ...] = (), scale_keyword: str = "scale",
            strict_head_dim: bool = False) -> bool:
    """Install the emulator as sys.modules["torch_npu"] (replacing an earlier emulator) unless
    a real torch_npu is importable. `without` drops ops (to test fallbacks); scale_keyword
    is "scale" (torch_npu >= 2.5) or "scale_value" (older). Returns whether it installed."""
    if real_torch_npu_importable():
        return False
    if scale_keyword not in ("scale", "scale_value"):
        raise ValueError(f"scale_keyword must be 'scale' or 'scale_value', got {scale_keyword!r}")
    mod = types.ModuleType("torch_npu", __doc__)
    mod.__spec__ = importlib.machinery.ModuleSpec("torch_npu", loader=None)
    mod.__version__ = "0.0.0+pdmesh.emulator"
    mod._pdmesh_emulator = True
    # what a tensor-parallel worker process installs too (common/parallel/worker.py)
    mod._pdmesh_install_options = {"without": tuple(without), "scale_keyword": scale_keyword,
                                   "strict_head_dim": strict_head_dim}
    mod.npu = types.SimpleNamespace(is_available=lambda: False, device_count=lambda: 0)
    from kernels.testing.fake_npu_kv_write import _npu_reshape_and_cache, npu_scatter_pa_kv_cache
    from kernels.testing.fake_npu_mla import OPS as MLA_OPS
    from kernels.testing.fake_npu_moe import OPS as MOE_OPS
    from kernels.testing.fake_npu_quant import OPS as QUANT_OPS
    ops = {"npu_scatter_pa_kv_cache": npu_scatter_pa_kv_cache,
           "_npu_reshape_and_cache": _npu_reshape_and_cache,
           "npu_fused_infer_attention_score": _make_fia(scale_keyword, strict_head_dim),
           "npu_rms_norm": npu_rms_norm, "npu_rotary_mul": npu_rotary_mul, **QUANT_OPS, **MOE_OPS, **MLA_OPS}
    unknown = set(without) - set(ops)
    if unknown:
        raise ValueError(f"without names unknown ops {sorted(unknown)}; ops: {sorted(ops)}")
    for name, fn in ops.items():
        if name not in without:
            setattr(mod, name, fn)
    sys.modules["torch_npu"] = mod
    return True


@contextlib.contextmanager
def installed(**options):
    """Install for the duration of a with-block (options as for install), then put back
    whatever sys.modules["torch_npu"] held before. Raises RuntimeError where a real
    torch_npu is importable."""
    previous = sys.modules.get("torch_npu")
    if not install(**options):
        raise RuntimeError("a real torch_npu is importable; refusing to emulate it")
    try:
        yield sys.modules["torch_npu"]
    finally:
        if previous is None:
            sys.modules.pop("torch_npu", None)
        else:
            sys.modules["torch_npu"] = previous


def uninstall() -> None:
    """Remove the emulator from sys.modules; a real torch_npu is left alone."""
    if is_emulated(sys.modules.get("torch_npu")):
        del sys.modules["torch_npu"]
