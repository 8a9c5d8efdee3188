"""The kv-store's Redis tier against a real redis-server: spill on eviction, promotion on a
memory miss with identical bytes, isolation of models, and a Redis that dies mid-run."""
from __future__ import annotations

import asyncio

import pytest

from services.kv_store.redis_tier import RedisTier, encode_block
from tests.kv_store_helpers import BLOCK_SIZE, ClientCache, chain, new_store, put_blocks
from tests.redis_server import redis_server  # noqa: F401  (fixture)

A = list(range(1000, 1000 + 4 * BLOCK_SIZE))
B = list(range(2000, 2000 + 4 * BLOCK_SIZE))


@pytest.fixture
def cache():
    c = ClientCache(num_blocks=16)
    yield c
    c.close()


def test_evicted_blocks_come_back_from_redis_with_identical_bytes(cache, redis_server):
    async def body():
        store = new_store(4, cache, RedisTier(redis_server.url, retry_s=0.2),
                          high_watermark=1.0, low_watermark=0.5)
        put_blocks(store, cache, "m", A, [3, 4, 5, 6])
        put_blocks(store, cache, "m", B, [8, 9, 10, 11])        # evicts all of A
        await store.flush()
        s = store.stats()
        assert (s["evictions"], s["redis_spilled"], s["redis_up"]) == (4, 4, True)
        hashes = chain(A, "m", cache.layout)
        assert await store.lookup("m", cache.layout, hashes) == (4, 0)
        pin_id, slots, promoted, space = await store.pin_get("m", cache.layout, hashes, A)
        assert promoted == 4 and len(slots) == 4
        for block_id, slot in zip([3, 4, 5, 6], slots):
            assert space.memory.read_slot(slot) == cache.block_bytes(block_id)
        assert await store.lookup("m", cache.layout, hashes) == (4, 4)
        store.release(pin_id)
        await store.flush()
        s = store.stats()
        assert (s["redis_promoted"], s["redis_spilled"], s["hits"]) == (4, 8, 4)  # B spilled too
        await store.close()
    asyncio.run(body())


def test_redis_values_never_cross_models_or_tokens(cache, redis_server):
    async def body():
        redis = RedisTier(redis_server.url)
        store = new_store(4, cache, redis, high_watermark=1.0, low_watermark=0.5)
        put_blocks(store, cache, "model-a", A, [0, 1, 2, 3])
        put_blocks(store, cache, "model-a", B, [4, 5, 6, 7])    # A spilled under model-a keys
        await store.flush()
        hashes = chain(A, "model-a", cache.layout)
        # model-b asks with model-a's hashes: its keys differ, nothing is found
        assert (await store.pin_get("model-b", cache.layout, hashes, A))[1] == []
        # a value planted under model-b's key but written for model-a is refused
        space_b = next(s for s in store.spaces.values() if s.model_id == "model-b")
        stolen = encode_block("model-a", space_b.key, A[:BLOCK_SIZE], b"\0" * space_b.memory.bytes_per_slot)
        await redis.spill([(redis.key("model-b", space_b.key, hashes[0]), stolen)])
        assert (await store.pin_get("model-b", cache.layout, hashes, A))[1] == []
        # model-a with other tokens under the same hash is refused as well
        wrong = [7] * BLOCK_SIZE + A[BLOCK_SIZE:]
        assert (await store.pin_get("model-a", cache.layout, hashes, wrong))[1] == []
        await store.close()
    asyncio.run(body())


def test_store_keeps_working_from_memory_while_redis_is_down(cache, redis_server):
    async def body():
        store = new_store(4, cache, RedisTier(redis_server.url, retry_s=0.2, timeout_s=0.5),
                          high_watermark=1.0, low_watermark=0.5)
        put_blocks(store, cache, "m", A, [0, 1, 2, 3])
        redis_server.stop(kill=True)
        put_blocks(store, cache, "m", B, [4, 5, 6, 7])          # evicts A; the spill fails
        await store.flush()
        s = store.stats()
        assert (s["redis_up"], s["redis_spilled"]) == (False, 0)
        assert s["redis_errors"] >= 1 and "spill" in s["redis_last_error"]
        hashes_b = chain(B, "m", cache.layout)
        pin_id, slots, promoted, _ = await store.pin_get("m", cache.layout, hashes_b, B)
        assert (len(slots), promoted) == (4, 0)                 # memory hits still served
        store.release(pin_id)
        assert (await store.pin_get("m", cache.layout, chain(A, "m", cache.layout), A))[1] == []
        redis_server.start()
        await asyncio.sleep(0.3)                                # past retry_s
        put_blocks(store, cache, "m", A, [0, 1, 2, 3])          # evicts B into the new Redis
        await store.flush()
        s = store.stats()
        assert (s["redis_up"], s["redis_spilled"]) == (True, 4)
        await store.close()
    asyncio.run(body())
