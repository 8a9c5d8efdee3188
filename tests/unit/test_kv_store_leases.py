"""kv-store leases against transfers that outlive them (the real servicer and client over
in-process gRPC, fake transfers that hold a read or a write in flight): a read that
outlives its pin while its slots get new blocks is a miss (slot generations), and a put
that outlives its reservation (by less than the transfer timeout, the most a transfer
runs) never commits, and its bytes land in cooling slots that nobody holds; the bytes a
valid read returns are always the committed block's."""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from common.config import TimeoutConfig
from protos.pdmesh.v1 import kv_store_pb2_grpc
from services.kv_store.client import KVStoreClient
from services.kv_store.servicer import KVStoreServicer
from tests.kv_store_helpers import BLOCK_SIZE, ClientCache, chain, new_store

SHORT = TimeoutConfig(transfer_s=0.2, cancel_ack_s=0.5, prefill_s=1.0, request_s=2.0,
                      kv_store_pin_lease_s=0.5, kv_store_reserve_lease_s=0.5, progress_s=1.0, stall_s=1.0)
TOKENS = list(range(100, 100 + 2 * BLOCK_SIZE))   # 2 full blocks


class Node:
    """A node's KV cache and its KVStoreClient."""

    def __init__(self, address: str, seed: int):
        self.cache = ClientCache(num_blocks=4, seed=seed)
        self.executor = ThreadPoolExecutor(2)
        self.client = KVStoreClient(address, "m", self.cache.layout, self.cache.sender, self.executor, SHORT)

    def blocks(self, ids) -> list[bytes]:
        return [self.cache.block_bytes(i) for i in ids]

    async def close(self) -> None:
        await self.client.close()
        self.executor.shutdown(wait=False)
        self.cache.close()


async def wait_held(node: Node) -> None:
    for _ in range(500):
        if node.cache.transfer.num_held:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("no transfer held")


def run(scenario):
    async def main():
        store_cache = ClientCache()          # only its layout: the store's pool is its own
        store = new_store(2, store_cache, timeouts=SHORT, high_watermark=1.0, low_watermark=1.0)
        server = grpc.aio.server()
        kv_store_pb2_grpc.add_KVStoreServicer_to_server(KVStoreServicer(store), server)
        address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        nodes = [Node(address, seed) for seed in (1, 2, 3)]
        try:
            result = await scenario(store, *nodes)
            assert store.stats()["blocks_pinned"] == 0   # every pin released or lapsed
            return result
        finally:
            for n in nodes:
                await n.close()
            await server.stop(None)
            store.transfer.close()
            store_cache.close()
    return asyncio.run(main())


def test_a_read_that_outlives_its_pin_while_its_slots_are_reused_is_a_miss():
    async def scenario(store, writer, reader, other):
        hashes = chain(TOKENS, "m", writer.cache.layout)
        assert await writer.client.put([0, 1], hashes, TOKENS) == 2
        pinned = await reader.client.pin(hashes, TOKENS)
        assert await reader.client.fetch(pinned, 0, 2, [2, 3])          # within its lease
        assert await reader.client.release(pinned)
        assert reader.blocks([2, 3]) == writer.blocks([0, 1])           # the committed bytes

        late = await reader.client.pin(hashes, TOKENS)
        reader.cache.transfer.hold()
        reading = asyncio.ensure_future(reader.client.fetch(late, 0, 2, [2, 3]))
        await wait_held(reader)
        await asyncio.sleep(SHORT.kv_store_pin_lease_s + 0.1)           # the pin lapses ...
        store.expire()
        other_tokens = list(range(500, 500 + 2 * BLOCK_SIZE))           # ... and its slots get other blocks
        assert await other.client.put([0, 1], chain(other_tokens, "m", other.cache.layout), other_tokens) == 2
        reader.cache.transfer.release_held()
        assert await reading                                            # the bytes moved, but:
        assert reader.blocks([2, 3]) == other.blocks([0, 1])            # they are another block's
        assert not await reader.client.release(late)                    # so it is a miss
    run(scenario)


def test_a_put_that_outlives_its_reservation_is_a_miss_and_lands_nowhere_in_use():
    async def scenario(store, late_writer, writer, reader):
        hashes = chain(TOKENS, "m", writer.cache.layout)
        late_writer.cache.transfer.hold()
        putting = asyncio.ensure_future(late_writer.client.put([0, 1], hashes, TOKENS))
        await wait_held(late_writer)
        await asyncio.sleep(SHORT.kv_store_reserve_lease_s + 0.05)      # the reservation lapses
        store.expire()
        assert store.stats()["expired_reservations"] == 1
        # its slots cool for transfer_bound_s: with a 2-slot pool nothing else can take them yet
        assert await writer.client.put([0, 1], hashes, TOKENS) == 0
        late_writer.cache.transfer.release_held()                       # the late bytes land there ...
        assert await putting == 0                                       # ... and its commit is refused
        await asyncio.sleep(SHORT.transfer_bound_s)
        store.expire()
        assert await writer.client.put([0, 1], hashes, TOKENS) == 2     # now written and committed
        pinned = await reader.client.pin(hashes, TOKENS)
        assert await reader.client.fetch(pinned, 0, 2, [0, 1]) and await reader.client.release(pinned)
        served = reader.blocks([0, 1])
        assert served == writer.blocks([0, 1]) != late_writer.blocks([0, 1])
    run(scenario)


def test_a_put_queued_behind_other_transfers_past_its_lease_never_starts():
    """The node's executor is shared with KV pushes: a put that gets a thread only once
    its reservation is nearly over (less than transfer_bound_s left) writes nothing, so no
    late bytes can land in slots that another put reserved since."""
    async def scenario(store, writer, reader, _):
        hashes = chain(TOKENS, "m", writer.cache.layout)
        busy = [writer.executor.submit(time.sleep, SHORT.kv_store_reserve_lease_s) for _ in range(2)]
        assert await writer.client.put([0, 1], hashes, TOKENS) == 0
        assert writer.cache.transfer.bytes_written == 0
        for f in busy:
            f.result()
        assert await reader.client.put([0, 1], hashes, TOKENS) == 0     # reserved by the first until it lapses
        await asyncio.sleep(SHORT.kv_store_reserve_lease_s)
        store.expire()                                                  # then its slots cool
        await asyncio.sleep(SHORT.transfer_bound_s)
        store.expire()
        assert await writer.client.put([0, 1], hashes, TOKENS) == 2
    run(scenario)
