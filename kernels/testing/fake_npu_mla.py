"""The Multi-head Latent Attention ops of the torch_npu emulator (fake_torch_npu.install() adds
them). Contracts as documented for Atlas A2/A3, from:
  op-plugin docs/zh/custom_APIs/torch_npu/torch_npu-npu_kv_rmsnorm_rope_cache.md,
  CANN ops-transformer docs aclnnKvRmsNormRopeCacheV2.md (the kernel's table: every tensor,
      the caches included, "非连续Tensor √", i.e. strided views are accepted),
  op-plugin docs/zh/custom_APIs/torch_npu/torch_npu-npu_fused_infer_attention_score.md
      (MLA约束, TND布局约束, PageAttention约束; query, key, value, query_rope and key_rope
      "不支持非连续Tensor": contiguous only),
  vllm-ascend vllm_ascend/attention/mla_v1.py (exec_kv_decode, _forward_decode with FIA v1,
      before #7222): nope cache [NB, BS, 1, 512] and rope cache [NB, BS, 1, 64], two
      contiguous tensors (worker/model_runner_v1.py cuts them from one buffer, end to end).
Each violation raises ContractError naming the rule, an unmodeled option NotImplementedError;
the math is float32, results in the input's dtype.

  npu_kv_rmsnorm_rope_cache(kv, gamma, cos, sin, index, k_cache, ckv_cache, *, k_rope_scale,
                            c_kv_scale, k_rope_offset, c_kv_offset, epsilon=1e-5,
                            cache_mode="Norm", is_output_kv=False)
      -> (k_cache, ckv_cache, k_embed_out, y_out)
      kv [B, 1, S, 576] (rms_size 512 + rope_size 64, the only sizes on A2/A3), float16 /
      bfloat16; gamma [512], cos / sin [B, 1, S, 64] or [B, 1, 1, 64], all of kv's dtype;
      y = kv[..., :512] * rsqrt(mean(x^2) + epsilon) * gamma;
      k = kv[..., 512:] de-interleaved (reshape [.., 32, 2], transpose: x0 x2 .. | x1 x3 ..),
      k_embed = k * cos + RotateHalf(k) * sin, RotateHalf(k) = (-k[32:], k[:32]).
      Modeled cache_mode "PA" / "PA_BNSD": k_cache [NB, BS, 1, 64], ckv_cache [NB, BS, 1, 512]
      of kv's dtype (no quantization), block_size 32-byte aligned, NB >= ceil(S / BS) * B;
      index int64 [B * S], unique, in [0, NB * BS); rows written in place; k_embed_out
      [B, 1, S, 64] and y_out [B, 1, S, 512] when is_output_kv (else empty).
  npu_fused_infer_attention_score, MLA mode (query_rope / key_rope given; the call routes
      here from fake_torch_npu): query D 512 (D 128: not modeled), query_rope D 64 and
      otherwise query's shape and dtype, key_rope D 64 and otherwise key's; num_heads = query
      N in {1, 2, 4, ..., 128}, one KV head (num_key_value_heads 1); page attention only
      (block_table int32 [B, >= blocks], block_size a multiple of 16 <= 1024,
      actual_seq_lengths_kv per request); key/value caches [NB, BS, 512] or, with BNSD / TND,
      [NB, 1, BS, 512], value shaped as key; layouts TND (actual_seq_lengths cumulative,
      sparse_mode 0 or 3 with the 2048 mask), BSND / BNSD with S = 1 (decode);
      softmax_lse_flag, antiquant and int8 not supported; all contiguous.
      out = softmax(scale * (q . k + q_rope . k_rope)) . value, shaped as query with D 512.

Relaxation, as for attention: float32 on emulated CPU tensors.
"""
from __future__ import annotations

import torch

from kernels.testing.fake_torch_npu import (_check_contiguous, _check_float, _check_mask, _fia_lengths, _host_ints,
                                            _require, paged_attention_math)

RMS_SIZE, ROPE_SIZE = 512, 64
CACHE_MODES = ("Norm", "PA", "PA_BNSD", "PA_NZ", "PA_BLK_BNSD", "PA_BLK_NZ")
FIA = "npu_fused_infer_attention_score"
MODELED = {"query_rope", "key_rope"}        # FIA keywords this module adds to fake_torch_npu's
MLA_QUERY_HEADS = (1, 2, 4, 8, 16, 32, 64, 128)
MLA_LAYOUTS = ("TND", "BSND", "BNSD")


def _same_dtype(op: str, like: torch.Tensor, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        _require(t.dtype == like.dtype, op, f"{name} dtype must equal kv's ({like.dtype}), got {t.dtype}")


def npu_kv_rmsnorm_rope_cache(kv, gamma, cos, sin, index, k_cache, ckv_cache, *, k_rope_scale=None,
                              c_kv_scale=None, k_rope_offset=None, c_kv_offset=None, epsilon=1e-5,
                              cache_mode="Norm", is_output_kv=False):
    op = "npu_kv_rmsnorm_rope_cache"
    if any(t is not None for t in (k_rope_scale, c_kv_scale, k_rope_offset, c_kv_offset)):
        raise NotImplementedError(f"{op}: the emulator does not model quantized caches")
    _require(cache_mode in CACHE_MODES, op, f"cache_mode must be one of {list(CACHE_MODES)}, got {cache_mode!r}")
    if cache_mode not in ("PA", "PA_BNSD"):
        raise NotImplementedError(f"{op}: the emulator models cache_mode 'PA' / 'PA_BNSD' only")
    _require(kv.dim() == 4 and kv.shape[1] == 1, op, f"kv must be 4-D [batch_size, 1, seq_len, hidden_size], "
                                                     f"got {list(kv.shape)}")
    _check_float(op, "kv", kv)
    _require(kv.shape[-1] == RMS_SIZE + ROPE_SIZE, op, f"hidden_size must be {RMS_SIZE + ROPE_SIZE} (rms_size "
                                                       f"{RMS_SIZE} + rope_size {ROPE_SIZE}), got {kv.shape[-1]}")
    batch, seq = kv.shape[0], kv.shape[2]
    _same_dtype(op, kv, gamma=gamma, cos=cos, sin=sin, k_cache=k_cache, ckv_cache=ckv_cache)
    _require(tuple(gamma.shape) == (RMS_SIZE,), op, f"gamma must be [{RMS_SIZE}], got {list(gamma.shape)}")
    for name, t in (("cos", cos), ("sin", sin)):
        _require(tuple(t.shape) in ((batch, 1, seq, ROPE_SIZE), (batch, 1, 1, ROPE_SIZE)), op,
                 f"{name} must be [{batch}, 1, {seq} or 1, {ROPE_SIZE}], got {list(t.shape)}")
    _require(k_cache.dim() == 4 and ckv_cache.dim() == 4 and k_cache.shape[:3] == ckv_cache.shape[:3]
             and k_cache.shape[2] == 1 and k_cache.shape[3] == ROPE_SIZE and ckv_cache.shape[3] == RMS_SIZE, op,
             f"k_cache must be [block_num, block_size, 1, {ROPE_SIZE}] and ckv_cache [block_num, block_size, 1, "
             f"{RMS_SIZE}], got {list(k_cache.shape)} and {list(ckv_cache.shape)}")
    num_blocks, block_size = k_cache.shape[:2]
    _require(block_size * kv.element_size() % 32 == 0, op, f"block_size must be 32-byte aligned, got {block_size}")
    _require(num_blocks >= -(-seq // block_size) * batch, op,
             f"block_num ({num_blocks}) must be >= ceil(seq_len / block_size) * batch_size "
             f"({-(-seq // block_size) * batch})")
    _require(index.dtype == torch.int64, op, f"index dtype must be int64, got {index.dtype}")
    _require(tuple(index.shape) == (batch * seq,), op, f"index must be [batch_size * seq_len] = [{batch * seq}], "
                                                       f"got {list(index.shape)}")
    capacity = num_blocks * block_size
    if index.numel():
        _require(int(index.min()) >= 0 and int(index.max()) < capacity, op,
                 f"index values must lie in [0, block_num * block_size = {capacity})")
        _require(index.unique().numel() == index.numel(), op, "index values must be unique")
    x = kv.float()
    rms_in, rope_in = x[..., :RMS_SIZE], x[..., RMS_SIZE:]
    y = rms_in * torch.rsqrt(rms_in.pow(2).mean(-1, keepdim=True) + epsilon) * gamma.float()
    k = rope_in.reshape(batch, 1, seq, ROPE_SIZE // 2, 2).transpose(-1, -2).reshape(batch, 1, seq, ROPE_SIZE)
    rotated = torch.cat([-k[..., ROPE_SIZE // 2:], k[..., :ROPE_SIZE // 2]], dim=-1)
    k_embed = k * cos.float() + rotated * sin.float()
    slots = index.long()
    blocks, offsets = slots // block_size, slots % block_size        # caches may be strided views
    ckv_cache[blocks, offsets, 0] = y.reshape(-1, RMS_SIZE).to(ckv_cache.dtype)
    k_cache[blocks, offsets, 0] = k_embed.reshape(-1, ROPE_SIZE).to(k_cache.dtype)
    if not is_output_kv:
        return k_cache, ckv_cache, kv.new_empty(0), kv.new_empty(0)
    return k_cache, ckv_cache, k_embed.to(kv.dtype), y.to(kv.dtype)


def _pages(key, value, key_rope, layout: str, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys [NB, BS, 1, 512 + 64] with the rope columns, values [NB, BS, 1, 512])."""
    shapes = [(block_size, RMS_SIZE)] + ([(1, block_size, RMS_SIZE)] if layout in ("BNSD", "TND") else [])
    _require(tuple(key.shape[1:]) in shapes and key.dim() in (3, 4), FIA,
             f"MLA key cache must be [blocks, {block_size}, 512]" + (
                 f" or [blocks, 1, {block_size}, 512]" if len(shapes) > 1 else "") + f" in layout {layout}, "
             f"got {list(key.shape)}")
    _require(value.shape == key.shape, FIA, "key and value must have the same shape")
    _require(tuple(key_rope.shape) == (*key.shape[:-1], ROPE_SIZE), FIA,
             f"key_rope must be key's shape with D {ROPE_SIZE}: {[*key.shape[:-1], ROPE_SIZE]}, "
             f"got {list(key_rope.shape)}")

    def paged(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(t.shape[0], block_size, 1, t.shape[-1])   # one KV head: both forms alike

    return torch.cat([paged(key), paged(key_rope)], dim=-1), paged(value)


def _queries(query, args: dict, layout: str) -> tuple[torch.Tensor, list[int], list[int]]:
    """(query as [T, N, D], q_lens, kv_lens) by layout."""
    if layout == "TND":
        _require(query.dim() == 3, FIA, f"TND query must be 3-D [T, N, D], got {list(query.shape)}")
        q_lens, kv_lens = _fia_lengths(FIA, args, query.shape[0])
        return query, q_lens, kv_lens
    _require(query.dim() == 4, FIA, f"{layout} query must be 4-D, got {list(query.shape)}")
    seq = query.shape[1] if layout == "BSND" else query.shape[2]
    if seq != 1:
        raise NotImplementedError(f"{FIA}: the emulator models MLA in {layout} for decode (S = 1) only")
    batch = query.shape[0]
    kv_lens = _host_ints(FIA, "actual_seq_lengths_kv", args["actual_seq_lengths_kv"])
    _require(len(kv_lens) == 1 or len(kv_lens) >= batch, FIA,
             f"actual_seq_lengths_kv must hold 1 or >= B ({batch}) entries, got {len(kv_lens)}")
    kv_lens = kv_lens * batch if len(kv_lens) == 1 else kv_lens[:batch]
    return query.reshape(batch, query.shape[-2] if layout == "BSND" else query.shape[1], -1), [1] * batch, kv_lens


def mla_attention(query, key, value, args: dict, scale, scale_keyword: str):
    """FIA with query_rope / key_rope: args as the op got them (defaults filled)."""
    q_rope, k_rope, layout = args["query_rope"], args["key_rope"], args["input_layout"]
    _require(q_rope is not None and k_rope is not None, FIA, "query_rope and key_rope must be given together")
    if layout not in MLA_LAYOUTS:
        raise NotImplementedError(f"{FIA}: the emulator models MLA in layouts {list(MLA_LAYOUTS)}, got {layout!r}")
    if args["block_table"] is None:
        raise NotImplementedError(f"{FIA}: the emulator models MLA with page attention only")
    _check_float(FIA, "query", query)
    _require(key.dtype == value.dtype == k_rope.dtype == q_rope.dtype == query.dtype, FIA,
             "MLA takes no int8 (antiquant): query, query_rope, key, value and key_rope share one dtype")
    _check_contiguous(FIA, query=query, key=key, value=value, query_rope=q_rope, key_rope=k_rope,
                      block_table=args["block_table"])
    head_dim = query.shape[-1]
    if head_dim == 128:
        raise NotImplementedError(f"{FIA}: the emulator models MLA with query D 512 only")
    _require(head_dim == RMS_SIZE, FIA, f"MLA query D must be 512 or 128, got {head_dim}")
    _require(tuple(q_rope.shape) == (*query.shape[:-1], ROPE_SIZE), FIA,
             f"query_rope must be query's shape with D {ROPE_SIZE}, got {list(q_rope.shape)}")
    q, q_lens, kv_lens = _queries(query, args, layout)
    heads = q.shape[1]
    _require(heads in MLA_QUERY_HEADS, FIA, f"MLA query N must be one of {list(MLA_QUERY_HEADS)}, got {heads}")
    _require(args["num_heads"] == heads, FIA, f"num_heads ({args['num_heads']}) must equal query's N ({heads})")
    _require((args["num_key_value_heads"] or heads) == 1, FIA,
             f"MLA needs one KV head (num_key_value_heads 1), got {args['num_key_value_heads'] or heads}")
    block_size, table = args["block_size"], args["block_table"]
    _require(block_size % 16 == 0 and 16 <= block_size <= 1024, FIA,
             f"MLA page attention needs block_size a multiple of 16 <= 1024, got {block_size}")
    k_cache, v_cache = _pages(key, value, k_rope, layout, block_size)
    _require(table.dtype == torch.int32 and table.dim() == 2 and table.shape[0] == len(q_lens), FIA,
             f"block_table must be int32 [B = {len(q_lens)}, max blocks], got {table.dtype} {list(table.shape)}")
    for b, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
        _require(q_len <= kv_len <= table.shape[1] * block_size, FIA,
                 f"request {b}: need q_len ({q_len}) <= kv_len ({kv_len}) <= block_table capacity")
        ids = table[b, :-(-kv_len // block_size)]
        _require(bool(((ids >= 0) & (ids < k_cache.shape[0])).all()), FIA,
                 f"request {b}: block ids must lie in [0, {k_cache.shape[0]})")
    mode = args["sparse_mode"]
    _require(mode in (0, 3, 4), FIA, f"MLA sparse_mode must be 0, 3 or 4, got {mode}")
    if mode == 4:
        raise NotImplementedError(f"{FIA}: the emulator does not model sparse_mode 4 (band)")
    if mode == 3:
        _check_mask(FIA, args["atten_mask"])
    elif args["atten_mask"] is not None:
        raise NotImplementedError(f"{FIA}: the emulator models MLA sparse_mode 0 without a mask only")
    _require(not args["softmax_lse_flag"], FIA, "MLA (query D 512) does not support softmax_lse_flag")
    _require(args["inner_precise"] in ((0, 1, 2, 3) if max(q_lens) > 1 else (0, 1)), FIA,
             f"inner_precise must be 0..3 (0 or 1 when every query length is 1), got {args['inner_precise']}")
    _require(isinstance(scale, float), FIA, f"{scale_keyword} must be a float, got {type(scale).__name__}")
    q_full = torch.cat([q, q_rope.reshape(*q.shape[:-1], ROPE_SIZE)], dim=-1)
    out, _ = paged_attention_math(q_full, k_cache, v_cache, table, q_lens, kv_lens, scale, causal=mode == 3)
    return out.reshape(*query.shape[:-1], RMS_SIZE), torch.zeros(1, device=query.device)


OPS = {"npu_kv_rmsnorm_rope_cache": npu_kv_rmsnorm_rope_cache}
