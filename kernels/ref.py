"""Pure-torch reference backend: runs on any device, accumulates softmax in float32.

Decode gathers each sequence's blocks in tiles of about TILE_BYTES (float32), so the
gathered K/V stay in cache while they are used; the whole decode is a fixed handful of
ops when the batch fits in one tile:

    block_tables[:, :max_blocks] --index_select--> [seqs, kv_heads, tokens, head_dim]
    query [seqs, kv_heads, group, head_dim] @ K^T -> mask pos >= seq_len -> softmax -> @ V
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.api import Backend, DecodeMetadata, PrefillMetadata
from kernels.kv_int8 import KVCacheScales, over_codes

TILE_BYTES = 2 << 20


class RefBackend(Backend):
    """Reference kernels in plain torch. Stateless; any block size."""

    name = "ref"

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = device

    def supported_block_sizes(self) -> list[int] | None:
        return None

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        valid = slot_mapping >= 0
        slots = slot_mapping[valid]
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, key[valid])
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, value[valid])

    def prefill(self, query, key, value, k_cache, v_cache, meta: PrefillMetadata,
                scale: float, kv_scales: KVCacheScales | None = None) -> torch.Tensor:
        """Per-sequence 4-D SDPA (the CPU flash kernel needs 4-D; its softmax accumulates
        in float32 for bf16/fp16, as do the CUDA kernels). A sequence without a cached prefix
        attends over key/value directly; one with a prefix reads its context from the
        caches under a bottom-right causal mask. An int8 cache: over its codes in float32,
        the scales folded around (kernels/kv_int8.py)."""
        if kv_scales is not None:
            return over_codes(self.prefill, query, kv_scales, key.float(), value.float(), k_cache, v_cache, meta,
                              scale)
        out = torch.empty_like(query)
        block_size, num_kv_heads, head_dim = k_cache.shape[1:]
        start = 0
        for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list)):
            end = start + q_len
            if q_len == 0:
                continue
            q = query[start:end].transpose(0, 1)
            if q_len == seq_len:
                k, v, mask = key[start:end], value[start:end], None
            else:
                blocks = meta.block_tables[i, :-(-seq_len // block_size)]
                k = k_cache.index_select(0, blocks).view(-1, num_kv_heads, head_dim)[:seq_len]
                v = v_cache.index_select(0, blocks).view(-1, num_kv_heads, head_dim)[:seq_len]
                k, v = k.to(q.dtype), v.to(q.dtype)
                mask = torch.ones(q_len, seq_len, dtype=torch.bool, device=query.device)
                mask = mask.tril(seq_len - q_len)
            o = F.scaled_dot_product_attention(
                q[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask,
                is_causal=mask is None, scale=scale, enable_gqa=True)
            out[start:end] = o[0].transpose(0, 1)
            start = end
        return out

    def decode(self, query, k_cache, v_cache, meta: DecodeMetadata,
               scale: float, kv_scales: KVCacheScales | None = None) -> torch.Tensor:
        """Batched over sequences (no per-request loop); loops only over tiles. The gather
        reads an int8 cache's codes as float32 (the scales folded around)."""
        if kv_scales is not None:
            return over_codes(self.decode, query, kv_scales, k_cache, v_cache, meta, scale)
        num_seqs, num_heads, head_dim = query.shape
        if num_seqs == 0:
            return torch.empty_like(query)
        block_size, num_kv_heads = k_cache.shape[1:3]
        max_blocks = -(-meta.max_seq_len // block_size)
        q = (query.float() * scale).reshape(num_seqs, num_kv_heads, -1, head_dim)
        block_tables = meta.block_tables[:, :max_blocks]
        block_bytes = block_size * num_kv_heads * head_dim * 4
        cols = max(1, TILE_BYTES // block_bytes)
        rows = max(1, TILE_BYTES // (max(1, min(cols, max_blocks)) * block_bytes))
        if rows >= num_seqs:
            out = _attend(q, k_cache, v_cache, block_tables, meta.seq_lens, cols)
        else:
            out = torch.cat([
                _attend(q[b:b + rows], k_cache, v_cache, block_tables[b:b + rows],
                        meta.seq_lens[b:b + rows], cols)
                for b in range(0, num_seqs, rows)])
        return out.view(num_seqs, num_heads, head_dim).to(query.dtype)

    def rms_norm(self, x, weight, eps: float) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return (h * weight.float()).to(x.dtype)

    def rotary(self, positions, query, key, cos, sin):
        """Bit-exact with transformers' apply_rotary_pos_emb in float32."""
        c = cos.index_select(0, positions).float().unsqueeze(1)
        s = sin.index_select(0, positions).float().unsqueeze(1)
        return _rotate(query, c, s), _rotate(key, c, s)


def _rotate(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, seqs: int) -> torch.Tensor:
    """Flat block ids [seqs * cols] -> float32 [seqs, kv_heads, cols * block_size, head_dim]."""
    _, block_size, num_kv_heads, head_dim = cache.shape
    cols = block_ids.numel() // seqs
    blocks = cache.index_select(0, block_ids)
    out = torch.empty(seqs, num_kv_heads, cols * block_size, head_dim,
                      dtype=torch.float32, device=cache.device)
    out.view(seqs, num_kv_heads, cols, block_size, head_dim).copy_(
        blocks.view(seqs, cols, block_size, num_kv_heads, head_dim).permute(0, 3, 1, 2, 4))
    return out


def _attend(q, k_cache, v_cache, block_tables, seq_lens, cols) -> torch.Tensor:
    """q float32 [seqs, kv_heads, group, head_dim], pre-scaled -> same shape."""
    seqs, num_blocks = block_tables.shape
    block_size = k_cache.shape[1]
    tiles = [(c, min(c + cols, num_blocks)) for c in range(0, num_blocks, cols)]
    ids = [block_tables[:, c0:c1].reshape(-1) for c0, c1 in tiles]
    if len(tiles) == 1:
        scores = torch.matmul(q, _gather(k_cache, ids[0], seqs).transpose(2, 3))
    else:
        scores = q.new_empty(*q.shape[:3], num_blocks * block_size)
        for (c0, c1), tile_ids in zip(tiles, ids):
            k = _gather(k_cache, tile_ids, seqs)
            scores[..., c0 * block_size:c1 * block_size] = torch.matmul(q, k.transpose(2, 3))
    positions = torch.arange(scores.shape[-1], device=q.device)
    scores.masked_fill_((positions >= seq_lens[:, None])[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if len(tiles) == 1:
        return torch.matmul(probs, _gather(v_cache, ids[0], seqs))
    out = None
    for (c0, c1), tile_ids in zip(tiles, ids):
        part = torch.matmul(probs[..., c0 * block_size:c1 * block_size],
                            _gather(v_cache, tile_ids, seqs))
        out = part if out is None else out.add_(part)
    return out
