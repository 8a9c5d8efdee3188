"""An int8 KV cache (msModelSlim's "C8"): keys and values stored as int8 codes with static
per-channel scales and offsets, one set per layer, from the checkpoint.

    store:  code = clamp(rint(x / scale + offset), -128, 127)      (rounding half to even)
    read:   x'   = (code - offset) * scale

Attention over the codes without dequantizing the cache (what `ref` and `cpu` run): for a
query q, score(t) = sum_c q[c] * (k8[t, c] - k_off[c]) * k_scale[c]
                  = sum_c (q[c] * k_scale[c]) * k8[t, c] - (a constant over t),
and softmax does not change when every score of a row moves by the same constant; then
out[c] = sum_t p(t) * (v8[t, c] - v_off[c]) * v_scale[c] = (sum_t p(t) * v8[t, c] - v_off[c]) * v_scale[c],
since the probabilities sum to 1. So attention runs on the raw codes with the query scaled
per channel first (`fold_query`) and the output mapped back per channel after
(`unfold_output`): the cache is read once, as int8, and never converted.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheScales:
    """One layer's C8 scales (float32 [num_kv_heads, head_dim], this rank's heads)."""

    k_scale: torch.Tensor
    k_offset: torch.Tensor
    v_scale: torch.Tensor
    v_offset: torch.Tensor


def quantize_kv(x: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """x [tokens, kv_heads, head_dim] -> int8 codes (the store rule above, in float32)."""
    return torch.round(x.float() / scale + offset).clamp_(-128, 127).to(torch.int8)


def dequantize_kv(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """int8 codes [..., kv_heads, head_dim] -> float32 values (the read rule)."""
    return (codes.float() - offset) * scale


def _per_query_head(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[kv_heads, head_dim] -> [num_heads, head_dim] (GQA: each kv head's row for its group)."""
    return t.repeat_interleave(num_heads // t.shape[0], dim=0)


def fold_query(query: torch.Tensor, scales: KVCacheScales) -> torch.Tensor:
    """query [tokens, num_heads, head_dim] times the key scale of its channel, in float32."""
    return query.float() * _per_query_head(scales.k_scale, query.shape[1])


def unfold_output(out: torch.Tensor, scales: KVCacheScales) -> torch.Tensor:
    """Attention output over the value codes [tokens, num_heads, head_dim] -> the output over
    the dequantized values, in float32."""
    heads = out.shape[1]
    return (out.float() - _per_query_head(scales.v_offset, heads)) * _per_query_head(scales.v_scale, heads)


def over_codes(attend, query: torch.Tensor, scales: KVCacheScales, *args) -> torch.Tensor:
    """attend(folded query, *args) over int8 codes -> the attention over the values, in
    query's dtype (a backend's prefill or decode called again without scales)."""
    return unfold_output(attend(fold_query(query, scales), *args), scales).to(query.dtype)
