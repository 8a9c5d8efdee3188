"""Pins named by their caller (services/kv_store/pin_names.py): a PinGet whose answer never
reaches the node (here: the store answers after the node's deadline) is released by name
at once, not held for the whole pin lease; a Release that overtakes its PinGet makes it
pin nothing; names are checked. The real servicer and client over in-process gRPC."""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from common.config import TimeoutConfig
from protos.pdmesh.v1 import kv_store_pb2, kv_store_pb2_grpc
from services.kv_store.client import KVStoreClient
from services.kv_store.servicer import KVStoreServicer
from tests.kv_store_helpers import BLOCK_SIZE, ClientCache, chain, new_store, put_blocks

TOKENS = list(range(100, 100 + 2 * BLOCK_SIZE))   # 2 full blocks
LONG_LEASE = TimeoutConfig(kv_store_call_s=0.3, kv_store_pin_lease_s=60.0)
LATE_S = 0.6          # the store's PinGet answers come this much later than the node waits


class LatePinGetAnswers(grpc.aio.ServerInterceptor):
    """PinGet runs at once (the pin is made), its answer leaves LATE_S later."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if not details.method.endswith("/PinGet"):
            return handler
        inner = handler.unary_unary

        async def late(request, context):
            reply = await inner(request, context)
            await asyncio.sleep(LATE_S)
            return reply
        return grpc.unary_unary_rpc_method_handler(late, handler.request_deserializer, handler.response_serializer)


class FirstReleaseLost(grpc.aio.ServerInterceptor):
    """The first Release never reaches the store (what a node stopped right after making
    the call sees: it resumes past the deadline without having sent it)."""

    def __init__(self):
        self.num_lost = 0

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if not details.method.endswith("/Release") or self.num_lost:
            return handler
        self.num_lost += 1

        async def lost(request, context):
            await asyncio.sleep(LATE_S)
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "lost")
        return grpc.unary_unary_rpc_method_handler(lost, handler.request_deserializer, handler.response_serializer)


def run(scenario, late: bool = False, interceptors=()):
    async def main():
        cache = ClientCache(num_blocks=4, seed=1)
        store = new_store(4, cache, timeouts=LONG_LEASE, high_watermark=1.0, low_watermark=1.0)
        server = grpc.aio.server(interceptors=([LatePinGetAnswers()] if late else []) + list(interceptors))
        kv_store_pb2_grpc.add_KVStoreServicer_to_server(KVStoreServicer(store), server)
        address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        executor = ThreadPoolExecutor(2)
        client = KVStoreClient(address, "m", cache.layout, cache.sender, executor, LONG_LEASE)
        try:
            put_blocks(store, cache, "m", TOKENS, [0, 1])
            result = await scenario(store, client, chain(TOKENS, "m", cache.layout), cache.layout)
            assert store.stats()["blocks_pinned"] == 0
            assert len(store.pin_names) == 0          # no binding or overtaken name left behind
            return result
        finally:
            await client.close()
            executor.shutdown(wait=False)
            await server.stop(None)
            store.transfer.close()
            cache.close()
    return asyncio.run(main())


async def pinned_blocks_after(store, seconds: float) -> int:
    await asyncio.sleep(seconds)
    return store.stats()["blocks_pinned"]


def test_a_pin_whose_answer_came_too_late_is_released_by_name_at_once():
    async def scenario(store, client, hashes, layout):
        assert await client.pin(hashes, TOKENS) is None            # the deadline passed first
        assert store.stats()["blocks_pinned"] == 2                  # ... after the store pinned both
        # the lease is 60 s: only the release by name frees them this soon
        assert await pinned_blocks_after(store, LATE_S + 0.5) == 0
        assert client.num_unanswered_pins_released == 1
    run(scenario, late=True)


def test_a_pin_cancelled_while_its_pinget_is_in_flight_is_released():
    async def scenario(store, client, hashes, layout):
        task = asyncio.ensure_future(client.pin(hashes, TOKENS))
        while not store.stats()["blocks_pinned"]:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await pinned_blocks_after(store, LATE_S + 0.5) == 0
        assert client.num_unanswered_pins_released == 1
    run(scenario, late=True)


def test_an_answered_pin_is_released_once_by_its_id():
    async def scenario(store, client, hashes, layout):
        pinned = await client.pin(hashes, TOKENS)
        assert pinned is not None and len(pinned.pin_id) == 32       # the client's name
        assert store.stats()["blocks_pinned"] == 2
        assert await client.release(pinned)
        assert store.stats()["blocks_pinned"] == 0
        assert client.num_unanswered_pins_released == 0
    run(scenario, late=False)


def test_a_release_that_got_no_answer_is_sent_again():
    lost = FirstReleaseLost()

    async def scenario(store, client, hashes, layout):
        pinned = await client.pin(hashes, TOKENS)
        assert await client.release(pinned) is True      # the second call's answer: a valid read
        assert lost.num_lost == 1 and store.stats()["blocks_pinned"] == 0
    run(scenario, interceptors=[lost])


def test_a_release_that_overtakes_its_pinget_makes_it_pin_nothing():
    async def scenario(store, client, hashes, layout):
        assert store.release("overtaken_name_1") is False
        assert len(store.pin_names) == 1
        assert await store.pin_get("m", layout, hashes, TOKENS, name="overtaken_name_1") == ("", [], 0, None)
        assert store.stats()["blocks_pinned"] == 0
        name, slots, _, _ = await store.pin_get("m", layout, hashes, TOKENS, name="overtaken_name_1")
        assert (name, len(slots)) == ("overtaken_name_1", 2)        # the overtaking is used up
        assert store.release(name) and store.stats()["blocks_pinned"] == 0
    run(scenario, late=False)


@pytest.mark.parametrize("name, match", [
    ("short", "pin_id must be empty or 8-64 characters"),
    ("has-a-dash-like-store-ids", "pin_id must be empty or 8-64 characters"),
    ("x" * 65, "pin_id must be empty or 8-64 characters"),
])
def test_malformed_pin_names_are_refused_naming_the_field(name, match):
    async def scenario(store, client, hashes, layout):
        with pytest.raises(ValueError, match=match):
            await store.pin_get("m", layout, hashes, TOKENS, name=name)
        assert store.stats()["blocks_pinned"] == 0
    run(scenario, late=False)


def test_a_malformed_pin_name_is_invalid_argument_over_grpc():
    async def scenario(store, client, hashes, layout):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await client.stub.PinGet(kv_store_pb2.PinGetRequest(
                space=client.space, block_hashes=hashes, token_ids=TOKENS, pin_id="no-dashes"), timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "pin_id must be empty or 8-64 characters of [0-9A-Za-z_]" in e.value.details()
        assert store.stats()["blocks_pinned"] == 0
    run(scenario, late=False)


def test_a_live_pins_name_cannot_be_reused():
    async def scenario(store, client, hashes, layout):
        name, _, _, _ = await store.pin_get("m", layout, hashes, TOKENS, name="live_name_12")
        with pytest.raises(ValueError, match="names a pin already"):
            await store.pin_get("m", layout, hashes, TOKENS, name="live_name_12")
        assert store.stats()["blocks_pinned"] == 2
        assert store.release(name) and store.stats()["blocks_pinned"] == 0
    run(scenario, late=False)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_named_pin_released_after_its_lease_still_checks_its_slots_then_is_forgotten():
    clock, cache = Clock(), ClientCache(num_blocks=4, seed=1)
    store = new_store(4, cache, clock=clock, timeouts=LONG_LEASE)
    put_blocks(store, cache, "m", TOKENS, [0, 1])
    hashes = chain(TOKENS, "m", cache.layout)

    async def pin(name):
        return await store.pin_get("m", cache.layout, hashes, TOKENS, name=name)

    name, slots, _, space = asyncio.run(pin("late_reader_1"))
    gens = store.generations(space, slots)
    clock.now += 61.0
    store.expire()                                   # the lease ended: the pin lapsed
    assert (store.stats()["blocks_pinned"], store.stats()["expired_pins"]) == (0, 1)
    assert store.release(name, slots, gens) is True  # ... but the slots still hold its blocks

    name, slots, _, _ = asyncio.run(pin("late_reader_2"))
    clock.now += 61.0
    store.expire()
    clock.now += 61.0
    store.expire()                                   # a lease past the lapse: the name is forgotten
    assert len(store.pin_names) == 0
    assert store.release(name, slots, gens) is False  # unknown now: a miss, and remembered a lease
    assert len(store.pin_names) == 1
    clock.now += 61.0
    store.expire()
    assert len(store.pin_names) == 0
    store.transfer.close()
    cache.close()


class HeldRedis:
    """The Redis tier's surface pin_get uses, with get_many held until `answer` is set:
    what a Release by name meets while the PinGet awaits a promotion."""

    def __init__(self):
        self.asked, self.answer = asyncio.Event(), asyncio.Event()
        self.up, self.last_error = True, ""
        self.num_promoted = self.num_spilled = self.num_errors = 0

    def key(self, model_id, layout_key, block_hash):
        return block_hash.hex()

    async def get_many(self, keys):
        self.asked.set()
        await self.answer.wait()
        return [None] * len(keys)


def test_a_release_by_name_while_the_pinget_awaits_redis_leaves_nothing_pinned():
    async def main():
        cache = ClientCache(num_blocks=4, seed=1)
        redis = HeldRedis()
        store = new_store(4, cache, redis=redis, timeouts=LONG_LEASE)
        put_blocks(store, cache, "m", TOKENS[:BLOCK_SIZE], [0])      # one block in memory, one to promote
        hashes = chain(TOKENS, "m", cache.layout)
        pinning = asyncio.ensure_future(store.pin_get("m", cache.layout, hashes, TOKENS, name="mid_promote_1"))
        await redis.asked.wait()
        assert store.stats()["blocks_pinned"] == 1                  # the memory hit, under the name
        assert store.release("mid_promote_1") is True
        redis.answer.set()
        assert (await pinning)[:3] == ("", [], 0)
        assert store.stats()["blocks_pinned"] == 0 and len(store.pin_names) == 0
        store.transfer.close()
        cache.close()
    asyncio.run(main())
