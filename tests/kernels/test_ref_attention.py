"""RefBackend attention and KV writes against float64 dense attention: mixed runner-like
steps (decode + fresh prefill + prefix hits + 1-token chunks), GQA 4:1, shuffled block ids,
padded last blocks, block sizes 16 and 128, float32 and bfloat16."""
from __future__ import annotations

import random

import pytest
import torch

import kernels.ref as ref
from kernels.api import DecodeMetadata, PrefillMetadata
from tests.kernels.paged_case import TOLERANCE, dense_attention, make_paged

SCALE = 32 ** -0.5


def _random_step(seed: int, block_size: int, num_decode: int, num_prefill: int):
    rng = random.Random(seed)
    query_lens, seq_lens = [], []
    for _ in range(num_decode):
        seq_lens.append(rng.randint(1, 3 * block_size + 5))
        query_lens.append(1)
    for i in range(num_prefill):
        cached = [0, rng.randint(1, 2 * block_size), block_size, rng.randint(1, 40)][i % 4]
        q_len = [rng.randint(1, 150), rng.randint(1, 70), block_size + 3, 1][i % 4]
        query_lens.append(q_len)
        seq_lens.append(cached + q_len)
    return query_lens, seq_lens


def _split_step(paged, num_decode: int):
    seq_lens = torch.tensor(paged.seq_lens, dtype=torch.int32)
    decode = DecodeMetadata(seq_lens[:num_decode], paged.block_tables[:num_decode],
                            paged.seq_lens[:num_decode])
    q_lens = paged.query_lens[num_decode:]
    prefill = PrefillMetadata(torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32),
                              seq_lens[num_decode:], paged.block_tables[num_decode:], q_lens,
                              paged.seq_lens[num_decode:])
    return decode, prefill


@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 1])
def test_runner_step_matches_dense(block_size, dtype, seed):
    num_decode, num_prefill = 5, 8
    query_lens, seq_lens = _random_step(seed, block_size, num_decode, num_prefill)
    paged = make_paged(query_lens, seq_lens, block_size=block_size, dtype=dtype, seed=seed)
    backend = ref.RefBackend()
    backend.write_kv(paged.key, paged.value, paged.k_cache, paged.v_cache, paged.slot_mapping)
    decode_meta, prefill_meta = _split_step(paged, num_decode)
    q_decode, q_prefill = paged.query[:num_decode], paged.query[num_decode:]
    out_decode = backend.decode(q_decode, paged.k_cache, paged.v_cache, decode_meta, SCALE)
    out_prefill = backend.prefill(q_prefill, paged.key[num_decode:], paged.value[num_decode:],
                                  paged.k_cache, paged.v_cache, prefill_meta, SCALE)
    assert out_decode.dtype == out_prefill.dtype == dtype
    assert out_decode.shape == q_decode.shape and out_prefill.shape == q_prefill.shape
    expected = dense_attention(paged, SCALE)
    torch.testing.assert_close(out_decode.double(), expected[:num_decode], **TOLERANCE[dtype])
    torch.testing.assert_close(out_prefill.double(), expected[num_decode:], **TOLERANCE[dtype])


def test_prefill_without_prefix_reads_new_tokens_not_the_cache():
    paged = make_paged([9, 30], [9, 30], block_size=16)
    out = ref.RefBackend().prefill(paged.query, paged.key, paged.value, paged.k_cache,
                                   paged.v_cache, paged.prefill_meta(), SCALE)
    torch.testing.assert_close(out.double(), dense_attention(paged, SCALE), **TOLERANCE[torch.float32])


@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 2), (4, 4), (6, 1)])
def test_decode_head_groupings(num_heads, num_kv_heads):
    seq_lens = [1, 16, 17, 100, 33]
    paged = make_paged([1] * 5, seq_lens, block_size=16, num_heads=num_heads,
                       num_kv_heads=num_kv_heads, seed=3)
    backend = ref.RefBackend()
    backend.write_kv(paged.key, paged.value, paged.k_cache, paged.v_cache, paged.slot_mapping)
    out = backend.decode(paged.query, paged.k_cache, paged.v_cache, paged.decode_meta(), SCALE)
    torch.testing.assert_close(out.double(), dense_attention(paged, SCALE), **TOLERANCE[torch.float32])


@pytest.mark.parametrize("tile_bytes", [1, 16 * 2 * 32 * 4 * 3, 16 * 2 * 32 * 4 * 40])
def test_decode_tiles_over_batch_and_blocks(monkeypatch, tile_bytes):
    monkeypatch.setattr(ref, "TILE_BYTES", tile_bytes)
    paged = make_paged([1] * 7, [3, 200, 64, 65, 1, 129, 90], block_size=16, seed=4)
    backend = ref.RefBackend()
    backend.write_kv(paged.key, paged.value, paged.k_cache, paged.v_cache, paged.slot_mapping)
    out = backend.decode(paged.query, paged.k_cache, paged.v_cache, paged.decode_meta(), SCALE)
    torch.testing.assert_close(out.double(), dense_attention(paged, SCALE), **TOLERANCE[torch.float32])


def test_empty_parts():
    paged = make_paged([1], [5], block_size=16)
    backend = ref.RefBackend()
    empty_q = paged.query[:0]
    decode = DecodeMetadata(torch.zeros(0, dtype=torch.int32), paged.block_tables[:0], [])
    prefill = PrefillMetadata(torch.zeros(1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32),
                              paged.block_tables[:0], [], [])
    assert backend.decode(empty_q, paged.k_cache, paged.v_cache, decode, SCALE).shape == empty_q.shape
    assert backend.prefill(empty_q, paged.key[:0], paged.value[:0], paged.k_cache, paged.v_cache,
                           prefill, SCALE).shape == empty_q.shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_skips_negative_slots(dtype):
    gen = torch.Generator().manual_seed(5)
    k_cache = torch.randn(6, 16, 2, 8, generator=gen).to(dtype)
    v_cache = torch.randn(6, 16, 2, 8, generator=gen).to(dtype)
    key = torch.randn(7, 2, 8, generator=gen).to(dtype)
    value = torch.randn(7, 2, 8, generator=gen).to(dtype)
    slots = torch.tensor([37, -1, 0, 95, -1, 50, 16], dtype=torch.int64)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected_k[slot // 16, slot % 16] = key[i]
            expected_v[slot // 16, slot % 16] = value[i]
    ref.RefBackend().write_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    ref.RefBackend().write_kv(key[:2], value[:2], k_cache, v_cache, torch.full((2,), -1))
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
