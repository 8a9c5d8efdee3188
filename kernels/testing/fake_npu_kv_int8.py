"""npu_fused_infer_attention_score over an int8 paged KV cache (pseudo-quantized,
"antiquant"), as the torch_npu emulator models it. Contract from op-plugin's
docs/zh/custom_APIs/torch_npu/torch_npu-npu_fused_infer_attention_score.md (and the older
docs/context page) and the kernel sources of hicann/ops-transformer
(incre_flash_attention_*: `(bmm2 + offset) * scale`); each violation is one ContractError:

- key and value int8 need key_antiquant_scale and value_antiquant_scale (the separate
  per-channel form; key_antiquant_mode = value_antiquant_mode = 0); the combined
  antiquant_scale form and the other modes are not modeled;
- page attention over int8 KV with a query length above 1 is not supported (prefill must
  dequantize first, as vLLM-Ascend does), and neither is layout TND: BSH with S = 1 here;
- query float16 / bfloat16 (float32 on emulated CPU tensors);
- each scale (and offset, when given) of query's dtype, shaped (1, H), (1, KV_N, D) or
  (1, KV_N, 1, D), key's and value's alike;
- dequantization per channel: x = (code + offset) * scale (offset None = 0).
"""
from __future__ import annotations

import torch

from kernels.testing.fake_torch_npu import _check_contiguous, _check_float, _require, paged_attention_math

OP = "npu_fused_infer_attention_score"
MODELED = {"key_antiquant_scale", "key_antiquant_offset", "value_antiquant_scale", "value_antiquant_offset",
           "key_antiquant_mode", "value_antiquant_mode"}


def _channels(name: str, t: torch.Tensor | None, query: torch.Tensor, kv_heads: int, head_dim: int):
    if t is None:
        return None
    shapes = ((1, kv_heads * head_dim), (1, kv_heads, head_dim), (1, kv_heads, 1, head_dim))
    _require(tuple(t.shape) in shapes, OP, f"{name} must be shaped one of {list(shapes)} per channel, "
                                           f"got {tuple(t.shape)}")
    _require(t.dtype == query.dtype, OP, f"{name} dtype must equal query's ({query.dtype}), got {t.dtype}")
    return t.reshape(kv_heads, head_dim).float()


def antiquant_decode(query, key, value, args: dict, scale: float):
    """The BSH decode over int8 caches [blocks, block_size, KV_H]; args as the op got them."""
    _require(args["key_antiquant_scale"] is not None and args["value_antiquant_scale"] is not None, OP,
             "int8 key/value need key_antiquant_scale and value_antiquant_scale")
    _require(args["antiquant_scale"] is None and args["antiquant_offset"] is None, OP,
             "the emulator models the separate key/value antiquant form only")
    _require(args["key_antiquant_mode"] == 0 and args["value_antiquant_mode"] == 0, OP,
             "the emulator models per-channel antiquant (key/value_antiquant_mode 0) only")
    _require(args["input_layout"] != "TND", OP, "input_layout TND does not support antiquant (int8 key/value)")
    _require(args["input_layout"] == "BSH", OP, f"the emulator models antiquant in layout BSH only, "
                                                f"got {args['input_layout']!r}")
    _require(args["block_table"] is not None, OP, "the emulator models antiquant with page attention only")
    _require(query.dim() == 3 and query.shape[1] == 1, OP,
             f"page attention over int8 key/value needs a query length of 1: BSH query (B, 1, H), "
             f"got {tuple(query.shape)}")
    _check_float(OP, "query", query)
    _require(key.dtype == value.dtype == torch.int8, OP, "key and value must both be int8")
    _check_contiguous(OP, query=query, key=key, value=value, block_table=args["block_table"])
    batch, _, hidden = query.shape
    num_heads = args["num_heads"]
    kv_heads = args["num_key_value_heads"] or num_heads
    _require(hidden % num_heads == 0 and num_heads % kv_heads == 0, OP,
             f"H ({hidden}) must split into num_heads ({num_heads}), a multiple of num_key_value_heads ({kv_heads})")
    head_dim = hidden // num_heads
    table, block_size = args["block_table"], args["block_size"]
    _require(table.dtype == torch.int32 and table.dim() == 2 and table.shape[0] == batch, OP,
             f"block_table must be int32 [B = {batch}, max_blocks], got {table.dtype} {tuple(table.shape)}")
    _require(block_size % 32 == 0 and 32 <= block_size <= 512, OP,
             f"page attention over int8 key/value needs block_size a multiple of 32 in [32, 512], got {block_size}")
    _require(key.dim() == 3 and tuple(key.shape[1:]) == (block_size, kv_heads * head_dim) and key.shape == value.shape,
             OP, f"key/value caches must be (blocks, {block_size}, {kv_heads * head_dim}), got {tuple(key.shape)}")
    kv_lens = args["actual_seq_lengths_kv"]
    _require(isinstance(kv_lens, (list, tuple)) and len(kv_lens) == batch, OP,
             f"actual_seq_lengths_kv must be a host list of B ({batch}) ints")
    capacity = table.shape[1] * block_size
    for b, n in enumerate(kv_lens):
        _require(1 <= n <= capacity, OP, f"request {b}: kv length {n} must lie in [1, {capacity}]")
        ids = table[b, :-(-n // block_size)]
        _require(bool(((ids >= 0) & (ids < key.shape[0])).all()), OP,
                 f"request {b}: block ids must lie in [0, {key.shape[0]}), got {ids.tolist()}")
    parts = [_channels(name, args[name], query, kv_heads, head_dim)
             for name in ("key_antiquant_scale", "key_antiquant_offset", "value_antiquant_scale",
                          "value_antiquant_offset")]
    k_scale, k_offset, v_scale, v_offset = parts
    caches = []
    for codes, s, off in ((key, k_scale, k_offset), (value, v_scale, v_offset)):
        x = codes.view(codes.shape[0], block_size, kv_heads, head_dim).float()
        caches.append((x if off is None else x + off) * s)
    out, _ = paged_attention_math(query.view(batch, num_heads, head_dim), caches[0], caches[1], table,
                                  [1] * batch, list(kv_lens), scale, causal=False)
    return out.view(batch, 1, hidden), torch.zeros(1, device=query.device)
