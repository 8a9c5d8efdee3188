"""A node's loaded weights, served to starting nodes of the same model identity: the
WeightSeed gRPC service (protos/pdmesh/v1/weights.proto) and the leases that keep the
weights registered with the transfer engine.

Lifecycle of a loader's lease:
    OpenWeights     identity and TP size must be this node's (FAILED_PRECONDITION), fewer
                    than max_clients loaders holding leases, or the caller one of them (each
                    rank of a tensor-parallel loader takes a lease of its own;
                    RESOURCE_EXHAUSTED); the first lease
                    registers every rank's pool with its transfer engine; the reply carries
                    each rank's endpoint, base address and manifest (bucket checksums)
    ...             the loader reads buckets one-sided; RenewWeights every lease_s / 3
    CloseWeights    or the lease lapses lease_s after its last open or renewal
    last lease gone the pools are unregistered: a transfer port exposes the weights only
                    while an admitted loader reads them (docs/security-data-plane.md)

The node keeps serving requests throughout: the reads are the transfer engine's, beside
the step thread. Internal: the server's interceptors admit only the mesh's identity.

Fault injection (tests): PDMESH_FAULT_INJECTION=1 and PDMESH_FAULT_CORRUPT_WEIGHT_BUCKET=i
flip one byte of rank 0's bucket i while it is registered (restored when the last lease
ends), so that a loader's checksum of it fails. The pool may be what the model computes
with (a backend that keeps dense weights): a test-only fault.
"""
from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from typing import Callable

import grpc

from common.runner.served_weights import RankPool
from common.tasks import cancel_task
from protos.pdmesh.v1 import common_pb2, weights_pb2, weights_pb2_grpc

log = logging.getLogger("pdmesh.node")
CORRUPT_BUCKET_ENV = "PDMESH_FAULT_CORRUPT_WEIGHT_BUCKET"
SWEEP_S = 1.0     # how often lapsed leases are looked for


class WeightSeedService(weights_pb2_grpc.WeightSeedServicer):
    def __init__(self, node_id: str, identity: str, ranks: list[RankPool], max_clients: int, lease_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self.node_id, self.identity, self.ranks = node_id, identity, ranks
        self.max_clients, self.lease_s, self.clock = max_clients, lease_s, clock
        self.leases: dict[str, tuple[str, float]] = {}    # lease id -> (loader, expiry)
        self.leases_granted = 0
        self._sweeper: asyncio.Task | None = None
        self._lock = asyncio.Lock()    # leases and registration change under it
        self._corrupt = _corrupt_bucket()
        self._restore: tuple[int, int] | None = None    # (address, byte) flipped by the fault

    @property
    def tensor_parallel_size(self) -> int:
        return len(self.ranks)

    def info(self) -> common_pb2.WeightSeedInfo:
        return common_pb2.WeightSeedInfo(identity=self.identity, tensor_parallel_size=self.tensor_parallel_size,
                                         total_bytes=sum(r.nbytes for r in self.ranks),
                                         max_clients=self.max_clients)

    @property
    def registered(self) -> bool:
        return any(r.registered for r in self.ranks)

    async def OpenWeights(self, request, context):
        if request.identity != self.identity or request.tensor_parallel_size != self.tensor_parallel_size:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"this seed serves identity {self.identity} at tensor_parallel_size "
                                f"{self.tensor_parallel_size}; asked for {request.identity[:64]!r} at "
                                f"{request.tensor_parallel_size}")
        loader = request.loader_node_id[:128]
        async with self._lock:
            await self._expire()
            loaders = {held or lease_id for lease_id, (held, _) in self.leases.items()}   # each anonymous one apart
            if (loader not in loaders or not loader) and len(loaders) >= self.max_clients:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"this seed serves {self.max_clients} loader(s) at a time (max_weight_clients); "
                                    "try another seed or the disk")
            if not self.registered:
                try:   # registering gigabytes (RDMA pins them) must not stall the streams on this loop
                    await asyncio.to_thread(self._register)
                except Exception as e:
                    await asyncio.to_thread(self._unregister)
                    log.error("%s: cannot register its weights for a loader: %s", self.node_id, e)
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "this seed cannot expose its weights now")
            lease_id = secrets.token_hex(16)
            self.leases[lease_id] = (loader, self.clock() + self.lease_s)
        self.leases_granted += 1
        self._ensure_sweeper()
        log.info("%s: serving its weights (%.1f MB) to %s (%d loader(s) now)", self.node_id,
                 sum(r.nbytes for r in self.ranks) / 1e6, loader or "a loader", len(self.leases))
        return weights_pb2.OpenWeightsResponse(lease_id=lease_id, lease_s=self.lease_s,
                                               ranks=[r.to_proto() for r in self.ranks])

    async def RenewWeights(self, request, context):
        async with self._lock:
            await self._expire()
            held = self.leases.get(request.lease_id)
            if held is None:
                await context.abort(grpc.StatusCode.NOT_FOUND, "no such lease (it lapsed or was closed)")
            self.leases[request.lease_id] = (held[0], self.clock() + self.lease_s)
        return weights_pb2.RenewWeightsResponse(lease_s=self.lease_s)

    async def CloseWeights(self, request, context):
        async with self._lock:
            held = self.leases.pop(request.lease_id, None)
            if held is not None:
                log.info("%s: %s finished reading its weights", self.node_id, held[0] or "a loader")
            await self._expire()
        return weights_pb2.CloseWeightsResponse()

    async def _expire(self) -> None:
        """Drop lapsed leases; unregister once none is left (with self._lock held)."""
        now = self.clock()
        for lease_id, (loader, expiry) in list(self.leases.items()):
            if expiry <= now:
                del self.leases[lease_id]
                log.warning("%s: the weight lease of %s lapsed", self.node_id, loader or "a loader")
        if not self.leases and self.registered:
            await asyncio.to_thread(self._unregister)

    def _register(self) -> None:
        for rank in self.ranks:
            rank.register()
        self._inject_corruption()

    def _unregister(self) -> None:
        self._undo_corruption()
        for rank in self.ranks:
            try:
                rank.unregister()
            except Exception as e:   # the engine closing beside us: nothing left to expose
                log.warning("%s: unregistering rank %d's weights: %s", self.node_id, rank.rank, e)

    def _ensure_sweeper(self) -> None:
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    async def _sweep(self) -> None:
        while self.leases:
            await asyncio.sleep(SWEEP_S)
            async with self._lock:
                await self._expire()

    async def close(self) -> None:
        await cancel_task(self._sweeper)
        async with self._lock:
            self.leases.clear()
            await asyncio.to_thread(self._unregister)

    def _inject_corruption(self) -> None:
        if self._corrupt is None:
            return
        pool = self.ranks[0].pool
        if self._corrupt >= pool.manifest.num_buckets:
            return
        start, _ = pool.manifest.bucket_range(self._corrupt)
        view = pool.buffer[start:start + 1]
        self._restore = (start, int(view.item()))
        view.fill_(self._restore[1] ^ 0xFF)
        log.warning("%s: fault injection: bucket %d of its weights corrupted while served", self.node_id,
                    self._corrupt)

    def _undo_corruption(self) -> None:
        if self._restore is not None:
            start, value = self._restore
            self.ranks[0].pool.buffer[start:start + 1].fill_(value)
            self._restore = None


def _corrupt_bucket() -> int | None:
    if os.environ.get("PDMESH_FAULT_INJECTION") != "1" or not os.environ.get(CORRUPT_BUCKET_ENV):
        return None
    return int(os.environ[CORRUPT_BUCKET_ENV])
