"""KVStore over the fake transfer engine (no Redis): bytes in equal bytes out, key spaces
never mix, bad input is named, leases end."""
from __future__ import annotations

import asyncio

import pytest
import torch

from common.config import TimeoutConfig
from services.kv_store.store import SpacesExhausted
from tests.kv_store_helpers import BLOCK_SIZE, ClientCache, chain, new_store, put_blocks

TOKENS = list(range(100, 100 + 4 * BLOCK_SIZE))   # 4 full blocks


@pytest.fixture
def cache():
    c = ClientCache()
    yield c
    c.close()


def test_put_then_pin_gets_the_same_bytes(cache):
    store = new_store(8, cache)
    slots = put_blocks(store, cache, "m", TOKENS, [5, 6, 7, 2])
    assert slots == [0, 1, 2, 3]
    space = next(iter(store.spaces.values()))
    for block_id, slot in zip([5, 6, 7, 2], slots):
        assert space.memory.read_slot(slot) == cache.block_bytes(block_id)
    hashes = chain(TOKENS, "m", cache.layout)
    pin_id, got, promoted, _ = asyncio.run(store.pin_get("m", cache.layout, hashes, TOKENS))
    assert (got, promoted) == ([0, 1, 2, 3], 0)
    assert store.stats()["blocks_pinned"] == 4
    assert store.release(pin_id) and not store.release(pin_id)
    s = store.stats()
    assert (s["hits"], s["misses"], s["blocks_used"], s["blocks_pinned"]) == (4, 0, 4, 0)
    assert s["bytes_in"] == s["bytes_out"] == 4 * space.memory.bytes_per_slot


def test_latent_blocks_round_trip_through_the_store():
    """An MLA model's latent blocks (one plane, one head): put once, read back whole into
    another node's latent cache; a K/V layout of the same sizes never reads them. (A TP
    node's ranks all use head offset 0, plan_shard's kv_head_start for one latent head, so
    they share this one space: rank_clients.py puts once.)"""
    writer, reader = ClientCache(latent=True, head_dim=24), ClientCache(latent=True, head_dim=24, seed=1)
    as_kv = ClientCache(heads=1, head_dim=24)
    try:
        store = new_store(8, writer)
        slots = put_blocks(store, writer, "m", TOKENS, [5, 6, 7, 2])
        space = next(iter(store.spaces.values()))
        assert space.key.endswith(":latent") and len(space.memory.planes) == 1
        assert space.memory.bytes_per_slot == 2 * BLOCK_SIZE * 24 * 4
        hashes = chain(TOKENS, "m", reader.layout)
        pin_id, got, _, _ = asyncio.run(store.pin_get("m", reader.layout, hashes, TOKENS))
        assert got == slots
        reader.sender.fetch_blocks(store.transfer.endpoint, space.memory.layout, got, [0, 1, 2, 3])
        assert store.release(pin_id)
        assert torch.equal(reader.kv[:, :, :4], writer.kv[:, :, [5, 6, 7, 2]])
        assert asyncio.run(store.lookup("m", as_kv.layout, chain(TOKENS, "m", as_kv.layout))) == (0, 0)
    finally:
        for c in (writer, reader, as_kv):
            c.close()


def test_split_latent_blocks_round_trip_through_the_store():
    """A split latent cache's blocks (c_kv and k_pe planes of their own widths, the npu
    backend's): each slot holds both planes' bytes in (layer, plane) order, read back whole
    into another split cache; a one-plane latent cache of the same row never reads them."""
    writer, reader = ClientCache(split_rope=8, head_dim=24), ClientCache(split_rope=8, head_dim=24, seed=1)
    one_plane = ClientCache(latent=True, head_dim=32)
    try:
        store = new_store(8, writer)
        slots = put_blocks(store, writer, "m", TOKENS, [5, 6, 7, 2])
        space = next(iter(store.spaces.values()))
        assert space.key.endswith(":latent_split:R8")
        assert [p.shape[2] for p in space.memory.planes] == [BLOCK_SIZE * 24 * 4, BLOCK_SIZE * 8 * 4]
        assert space.memory.bytes_per_slot == 2 * BLOCK_SIZE * 32 * 4
        for block_id, slot in zip([5, 6, 7, 2], slots):
            assert space.memory.read_slot(slot) == writer.block_bytes(block_id)
        hashes = chain(TOKENS, "m", reader.layout)
        pin_id, got, _, _ = asyncio.run(store.pin_get("m", reader.layout, hashes, TOKENS))
        assert got == slots
        reader.sender.fetch_blocks(store.transfer.endpoint, space.memory.layout, got, [0, 1, 2, 3])
        assert store.release(pin_id)
        assert torch.equal(reader.kv.nope[:, :4], writer.kv.nope[:, [5, 6, 7, 2]])
        assert torch.equal(reader.kv.rope[:, :4], writer.kv.rope[:, [5, 6, 7, 2]])
        assert not torch.equal(reader.kv.rope[:, 4], writer.kv.rope[:, 4])     # nothing else written
        assert asyncio.run(store.lookup("m", one_plane.layout, chain(TOKENS, "m", one_plane.layout))) == (0, 0)
    finally:
        for c in (writer, reader, one_plane):
            c.close()


def test_a_second_put_writes_only_missing_blocks(cache):
    store = new_store(8, cache)
    put_blocks(store, cache, "m", TOKENS[:2 * BLOCK_SIZE], [0, 1])
    hashes = chain(TOKENS, "m", cache.layout)
    put_id, indices, slots, _ = store.reserve_put("m", cache.layout, hashes, TOKENS)
    assert (indices, slots) == ([2, 3], [2, 3])


def test_blocks_never_cross_models_or_layouts(cache):
    store = new_store(8, cache, max_spaces=4)
    put_blocks(store, cache, "model-a", TOKENS, [0, 1, 2, 3])
    hashes_a = chain(TOKENS, "model-a", cache.layout)
    # another model asking with model-a's exact hashes and tokens still misses
    assert asyncio.run(store.lookup("model-b", cache.layout, hashes_a)) == (0, 0)
    assert asyncio.run(store.pin_get("model-b", cache.layout, hashes_a, TOKENS))[:2] == ("", [])
    bf16 = ClientCache(dtype=torch.bfloat16)
    wider = ClientCache(heads=4)
    try:
        for other in (bf16, wider):
            assert asyncio.run(store.lookup("model-a", other.layout, hashes_a)) == (0, 0)
            assert asyncio.run(store.pin_get("model-a", other.layout, hashes_a, TOKENS))[1] == []
    finally:
        bf16.close()
        wider.close()
    assert asyncio.run(store.lookup("model-a", cache.layout, hashes_a)) == (4, 4)


def test_each_head_offset_is_a_space_of_its_own(cache):
    """Two tensor-parallel ranks with the same layout (heads 0-1 and 2-3 of a TP-2 node)
    never read each other's blocks; rank 0's space is the plain layout's."""
    store = new_store(8, cache, max_spaces=4)
    put_blocks(store, cache, "m", TOKENS, [0, 1, 2, 3])            # offset 0
    hashes = chain(TOKENS, "m", cache.layout)
    assert asyncio.run(store.lookup("m", cache.layout, hashes, head_offset=2)) == (0, 0)
    assert asyncio.run(store.pin_get("m", cache.layout, hashes, TOKENS, head_offset=2))[:2] == ("", [])
    put_id, indices, slots, space = store.reserve_put("m", cache.layout, hashes, TOKENS, head_offset=2)
    assert indices == [0, 1, 2, 3] and space.key == "float32:L2:H2:D8:B4:O2"
    assert store.has_space("m", cache.layout) and store.has_space("m", cache.layout, 2)
    assert asyncio.run(store.lookup("m", cache.layout, hashes, head_offset=0)) == (4, 4)
    for bad in (1, 3, -2):
        with pytest.raises(ValueError, match=f"space.head_offset must be a non-negative multiple of "
                                             rf"layout.num_kv_heads \(2\), got {bad}"):
            store.reserve_put("m", cache.layout, hashes, TOKENS, head_offset=bad)


def test_pin_checks_the_stored_tokens(cache):
    store = new_store(8, cache)
    put_blocks(store, cache, "m", TOKENS, [0, 1, 2, 3])
    hashes = chain(TOKENS, "m", cache.layout)
    wrong = TOKENS[:BLOCK_SIZE] + [7] * BLOCK_SIZE + TOKENS[2 * BLOCK_SIZE:]
    assert asyncio.run(store.pin_get("m", cache.layout, hashes, wrong))[1] == [0]


def test_a_tensor_parallel_nodes_head_offsets_count_once_against_max_spaces(cache):
    store = new_store(8, cache, max_spaces=1)
    hashes = chain(TOKENS, "m", cache.layout)
    for offset in (0, 2, 4, 6):              # a TP-4 node's ranks
        store.reserve_put("m", cache.layout, hashes, TOKENS, head_offset=offset)
    assert len(store.spaces) == 4
    with pytest.raises(SpacesExhausted, match="the store holds 1 key spaces"):
        store.reserve_put("other", cache.layout, chain(TOKENS, "other", cache.layout), TOKENS)


def test_max_spaces_is_enforced(cache):
    store = new_store(8, cache, max_spaces=1)
    put_blocks(store, cache, "a", TOKENS, [0, 1, 2, 3])
    with pytest.raises(SpacesExhausted, match="max_spaces"):
        put_blocks(store, cache, "b", TOKENS, [0, 1, 2, 3])


@pytest.mark.parametrize("hashes, tokens, match", [
    ([b"short"], [1] * BLOCK_SIZE, "block_hashes\\[0\\] has 5 bytes"),
    ([bytes(16)], [1] * (BLOCK_SIZE - 1), f"token_ids has {BLOCK_SIZE - 1} ids"),
])
def test_bad_arguments_name_the_field(cache, hashes, tokens, match):
    store = new_store(8, cache)
    with pytest.raises(ValueError, match=match):
        store.reserve_put("m", cache.layout, hashes, tokens)
    with pytest.raises(ValueError, match="model_id"):
        store.reserve_put("", cache.layout, [bytes(16)], [1] * BLOCK_SIZE)


def test_uncommitted_put_expires_and_commit_then_fails(cache):
    now = [0.0]
    timeouts = TimeoutConfig(transfer_s=1.0, kv_store_reserve_lease_s=5.0)
    store = new_store(8, cache, clock=lambda: now[0], timeouts=timeouts)
    hashes = chain(TOKENS, "m", cache.layout)
    put_id, _, slots, space = store.reserve_put("m", cache.layout, hashes, TOKENS)
    assert store.stats()["blocks_used"] == 4
    now[0] = 5.0
    store.expire()
    s = store.stats()
    assert (s["blocks_used"], s["expired_reservations"]) == (4, 1)   # cooling: a late write may land
    now[0] = 7.0                      # 2 x transfer_s later
    store.expire()
    assert store.stats()["blocks_used"] == 0
    with pytest.raises(KeyError):
        store.commit_put(put_id)
    assert asyncio.run(store.lookup("m", cache.layout, hashes)) == (0, 0)
