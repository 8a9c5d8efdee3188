"""Random paged-attention batches and a float64 dense reference for the kernel tests."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.api import DecodeMetadata, PrefillMetadata


@dataclass
class Paged:
    """A random batch laid out in shuffled blocks. Contexts hold every sequence's full K/V
    (float64); the caches hold the first seq_len - q_len tokens of each, or all of them
    when written by write_kv."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    contexts: list[tuple[torch.Tensor, torch.Tensor]]
    query_lens: list[int]
    seq_lens: list[int]

    def prefill_meta(self) -> PrefillMetadata:
        starts = torch.tensor([0, *self.query_lens]).cumsum(0)
        return PrefillMetadata(starts.to(torch.int32), torch.tensor(self.seq_lens, dtype=torch.int32),
                               self.block_tables, list(self.query_lens), list(self.seq_lens))

    def decode_meta(self) -> DecodeMetadata:
        assert all(q == 1 for q in self.query_lens)
        return DecodeMetadata(torch.tensor(self.seq_lens, dtype=torch.int32), self.block_tables,
                              list(self.seq_lens))


def make_paged(query_lens, seq_lens, *, block_size, num_heads=8, num_kv_heads=2, head_dim=32,
               dtype=torch.float32, extra_blocks=3, pad_blocks=2, seed=0) -> Paged:
    """Blocks are a random permutation of the pool; block tables carry pad_blocks zero
    columns past the widest sequence; new tokens are not yet in the caches."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + extra_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    width = max(blocks_per_seq) + pad_blocks
    block_tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    contexts, queries, keys, values, slots = [], [], [], [], []
    used = 0
    for i, (q_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
        ids = perm[used:used + blocks_per_seq[i]]
        used += blocks_per_seq[i]
        block_tables[i, :len(ids)] = ids.to(torch.int32)
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        pos = torch.arange(seq_len)
        seq_slots = ids[pos // block_size] * block_size + pos % block_size
        cached = seq_len - q_len
        k_cache.view(-1, num_kv_heads, head_dim)[seq_slots[:cached]] = k[:cached]
        v_cache.view(-1, num_kv_heads, head_dim)[seq_slots[:cached]] = v[:cached]
        contexts.append((k.double(), v.double()))
        keys.append(k[cached:])
        values.append(v[cached:])
        slots.append(seq_slots[cached:])
        queries.append(torch.randn(q_len, num_heads, head_dim, generator=gen).to(dtype))
    return Paged(k_cache, v_cache, block_tables, torch.cat(slots), torch.cat(queries),
                 torch.cat(keys), torch.cat(values), contexts, list(query_lens), list(seq_lens))


def dense_attention(paged: Paged, scale: float) -> torch.Tensor:
    """float64 per-sequence causal attention, bottom-right aligned; query head h reads
    kv head h // (num_heads // num_kv_heads)."""
    num_heads = paged.query.shape[1]
    outs = []
    start = 0
    for (k, v), q_len, seq_len in zip(paged.contexts, paged.query_lens, paged.seq_lens):
        q = paged.query[start:start + q_len].double().transpose(0, 1)
        start += q_len
        group = num_heads // k.shape[1]
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        scores = q @ k.transpose(1, 2) * scale
        visible_until = torch.arange(q_len)[:, None] + (seq_len - q_len)
        scores = scores.masked_fill(torch.arange(seq_len)[None, :] > visible_until, float("-inf"))
        outs.append((torch.softmax(scores, dim=-1) @ v).transpose(0, 1))
    return torch.cat(outs)


TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}

