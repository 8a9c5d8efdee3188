"""How much of a request's prefix the kv-store holds, for cache_aware routing.

One KVStore.Lookup per routed request, only under cache_aware, with a short deadline:
routing must not wait on the store, so a slow or absent store counts as zero hits (and
is logged once per outage). The key space is the model's, with the KV layout the
prefill nodes registered (all of a model's nodes share it).

Thread-safety: the meta-server's event loop only.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

import grpc

from protos.pdmesh.v1 import kv_store_pb2, kv_store_pb2_grpc
from services.node import grpc_util

log = logging.getLogger("pdmesh.meta")


class StoreHits:
    def __init__(self, address: str, timeout_s: float = 0.05):
        self.address, self.timeout_s = address, timeout_s
        self._channel = grpc_util.channel(address)
        self._stub = kv_store_pb2_grpc.KVStoreStub(self._channel)
        self._failing = False

    async def leading_hits(self, members: Sequence, model_id: str, hashes: Sequence[bytes]) -> int:
        """members: live Members; the first prefill node of the model gives the layout."""
        if not hashes:
            return 0
        node = next((m.info for m in members if m.role == "prefill"
                     and (not model_id or m.info.model_id == model_id)), None)
        if node is None:
            return 0
        space = kv_store_pb2.KeySpace(model_id=node.model_id, layout=node.kv_layout)
        try:
            reply = await self._stub.Lookup(kv_store_pb2.LookupRequest(space=space, block_hashes=hashes),
                                            timeout=self.timeout_s)
        except grpc.aio.AioRpcError as e:
            if not self._failing:
                log.warning("kv-store at %s: Lookup failed (%s); routing without its hits",
                            self.address, e.code().name)
            self._failing = True
            return 0
        self._failing = False
        return reply.num_hits

    async def close(self) -> None:
        await self._channel.close()
