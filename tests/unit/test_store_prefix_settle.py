"""When a prefill node's read from the kv-store gave up with ranges in flight, its blocks
stay quarantined until the store has run (answers) or been gone (refuses connections)
for 2 x transfer_s: a stopped store, which still accepts connections but answers
nothing, keeps them quarantined however long it stays stopped, since it would send the
rest of the read when continued."""
from __future__ import annotations

import asyncio
import dataclasses
import socket
import time
from concurrent.futures import ThreadPoolExecutor

from tests.kv_store_helpers import ClientCache
from tests.unit.test_kv_store_leases import SHORT
from services.kv_store.client import KVStoreClient
from services.prefill.store_prefix import StorePrefix

HANG_GUARD_S = 30.0     # a wait's bound: only catches a hang, never a slow host
# settled() frees an unsettled read at the latest after request_s + transfer_bound_s; far
# past the guard here, so settling within it can only be the store answering or refusing
# for transfer_bound_s (with SHORT's 2 s, a slow host would reach that cap instead).
TIMEOUTS = dataclasses.replace(SHORT, request_s=10 * HANG_GUARD_S)


def test_a_stopped_store_keeps_an_unsettled_read_quarantined_until_it_is_gone():
    async def scenario():
        silent = socket.socket()            # a stopped store: the kernel accepts, nobody answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        cache, executor = ClientCache(), ThreadPoolExecutor(2)
        client = KVStoreClient(address, "m", cache.layout, cache.sender, executor, TIMEOUTS)
        try:
            prefix = StorePrefix(client, list(range(100, 140)), "m", "layout")
            settling = asyncio.ensure_future(prefix.settled())
            await asyncio.sleep(4 * TIMEOUTS.transfer_bound_s)
            assert not settling.done()      # stopped: not after any time
            silent.close()                  # the process is gone: its port refuses
            gone = time.monotonic()
            await asyncio.wait_for(settling, HANG_GUARD_S)
            return time.monotonic() - gone
        finally:
            silent.close()
            await client.close()
            executor.shutdown(wait=False)
            cache.close()

    after = asyncio.run(scenario())
    print(f"settled {after:.2f} s after the store was gone")
    assert after >= TIMEOUTS.transfer_bound_s


def test_an_unsettled_read_from_a_running_store_settles_after_the_transfer_bound():
    async def scenario():
        import grpc
        from protos.pdmesh.v1 import kv_store_pb2_grpc
        from services.kv_store.servicer import KVStoreServicer
        from tests.kv_store_helpers import new_store
        store = new_store(2, ClientCache(), timeouts=TIMEOUTS)
        server = grpc.aio.server()
        kv_store_pb2_grpc.add_KVStoreServicer_to_server(KVStoreServicer(store), server)
        address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        cache, executor = ClientCache(), ThreadPoolExecutor(2)
        client = KVStoreClient(address, "m", cache.layout, cache.sender, executor, TIMEOUTS)
        try:
            prefix = StorePrefix(client, list(range(100, 140)), "m", "layout")
            start = time.monotonic()
            await asyncio.wait_for(prefix.settled(), HANG_GUARD_S)
            return time.monotonic() - start
        finally:
            await client.close()
            await server.stop(None)
            executor.shutdown(wait=False)
            cache.close()

    took = asyncio.run(scenario())
    print(f"settled after {took:.2f} s of a running store")
    assert took >= TIMEOUTS.transfer_bound_s       # never before a late range could still land
