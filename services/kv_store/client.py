"""A node's handle on the kv-store: control by gRPC, bytes by the node's transfer engine
between its KV cache and the store's pool.

    get:  pin(hashes, token_ids) -> Pinned | None ; fetch(pinned, from, to, block_ids) ;
          release(pinned) -> the read was valid (the slots held those blocks throughout)
          Each PinGet names its pin (a UUID): when its answer does not come back (deadline,
          cancel, this process stopped meanwhile) the pin is released by that name in the
          background, instead of holding the store's blocks for the whole pin lease; a
          Release that gets no answer is sent once more (ending a pin twice is harmless).
    put:  put(block_ids, hashes, token_ids) -> blocks written (reserve, write, commit)

The store is an optimisation, never a dependency: every failure (store down, timeout,
transfer error, another transfer backend) is logged once per outage and reads as a miss
or a skipped put. Each control call is bounded by timeouts.kv_store_call_s (a Release
that got no answer is sent once more: twice that). A transfer starts only while its
lease (pin or reservation) has more than timeouts.transfer_bound_s left, and ends within
it: it never outlives the lease it relies on, and a read that does anyway is caught by
the slot generations at release.

A tensor-parallel node has one client per rank (services/kv_store/rank_clients.py): each
moves its rank's heads, in its own key space (KeySpace.head_offset), through a sender
that moves that rank's cache (the worker's: common/parallel/rank_writes.WorkerSender).

Thread-safety: event loop only; the transfers run on the node's executor.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

import grpc

from common.config import TimeoutConfig
from common.transfer.base import TransferError
from common.transfer.kv_writes import KVSender
from common.kv_layout import KVLayout
from protos.pdmesh.v1 import kv_store_pb2, kv_store_pb2_grpc
from services.kv_store.pin_names import NAME
from services.node import grpc_util

log = logging.getLogger("pdmesh.kv_store.client")

# codes the store answers itself, having pinned nothing; after any other failure of a
# PinGet the store may hold the pin: it is released by name (UNAVAILABLE too: a store that
# is down refuses that Release as well, and one that answered it pinned nothing and just
# remembers the name for a lease)
PINNED_NOTHING = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                            grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED,
                            grpc.StatusCode.NOT_FOUND})


@dataclass
class Pinned:
    pin_id: str
    slot_ids: list[int]
    generations: list[int]
    endpoint: str
    layout: KVLayout
    expires_at: float              # time.monotonic() when the pin's lease ends
    unsettled: bool = False        # a read gave up with ranges in flight: they may still land


class KVStoreClient:
    def __init__(self, address: str, model_id: str, local_layout: KVLayout, sender: KVSender,
                 executor: Executor, timeouts: TimeoutConfig = TimeoutConfig(), head_offset: int = 0,
                 transfer_backend: str | None = None):
        """sender: moves the local blocks (send_blocks / fetch_blocks); head_offset: the
        first KV head they hold (a tensor-parallel rank's); transfer_backend: the name of
        the sender's engine (default sender.engine.name)."""
        self.address, self.timeouts = address, timeouts
        self.timeout_s = timeouts.kv_store_call_s
        self.sender, self.executor = sender, executor
        self.transfer_backend = transfer_backend or sender.engine.name
        self.space = kv_store_pb2.KeySpace(model_id=model_id, layout=local_layout.to_proto(),
                                           head_offset=head_offset)
        self.block_size = local_layout.block_size
        self._channel = grpc_util.channel(address)
        self.stub = kv_store_pb2_grpc.KVStoreStub(self._channel)
        self.available = True
        self.num_loaded_blocks = self.num_put_blocks = 0
        self.num_unanswered_pins_released = 0     # pins ended by name after a lost PinGet answer
        self._releases: set[asyncio.Task] = set()
        self._closed = False

    async def answers(self, timeout_s: float) -> bool:
        """Whether the store answers a Stats call within timeout_s (its process runs)."""
        try:
            await self.stub.Stats(kv_store_pb2.StatsRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return False
        return True

    def _failed(self, what: str, exc: BaseException) -> None:
        if isinstance(exc, grpc.aio.AioRpcError):
            exc = f"{exc.code().name}: {exc.details()}"
        if self.available:
            log.warning("kv-store at %s: %s failed (%s); continuing without it", self.address, what, exc)
        self.available = False

    def _ok(self) -> None:
        if not self.available:
            log.warning("kv-store at %s is back", self.address)
        self.available = True

    def _region_usable(self, region: kv_store_pb2.StoreRegion) -> KVLayout | None:
        if region.transfer_backend != self.transfer_backend:
            self._failed("transfer", f"the store uses transfer backend {region.transfer_backend!r}, "
                                     f"this node {self.transfer_backend!r}")
            return None
        return KVLayout.from_proto(region.layout)

    # ---- get ----------------------------------------------------------------------
    async def pin(self, hashes: Sequence[bytes], token_ids: Sequence[int]) -> Pinned | None:
        """Pin the store's leading hits of the chain; None when it holds none or fails."""
        if not hashes:
            return None
        asked, name = time.monotonic(), uuid.uuid4().hex
        try:
            reply = await self.stub.PinGet(kv_store_pb2.PinGetRequest(
                space=self.space, block_hashes=hashes, token_ids=token_ids, pin_id=name),
                timeout=self.timeout_s)
        except grpc.aio.AioRpcError as e:
            self._failed("PinGet", e)
            if e.code() not in PINNED_NOTHING:
                self._release_unanswered(name)
            return None
        except asyncio.CancelledError:
            self._release_unanswered(name)
            raise
        self._ok()
        if not reply.pin_id:
            return None
        layout = self._region_usable(reply.region)
        pinned = Pinned(reply.pin_id, list(reply.slot_ids), list(reply.generations),
                        reply.region.transfer_endpoint, layout, asked + reply.lease_seconds)
        if layout is None:
            await self.release(pinned)
            return None
        return pinned

    def _release_unanswered(self, name: str) -> None:
        """End the pin a PinGet may have made without its answer reaching us (best effort:
        the pin's lease ends it anyway; none once close() began)."""
        if self._closed:
            return

        async def release() -> None:
            try:
                reply = await self._release_call(kv_store_pb2.ReleaseRequest(pin_id=name))
            except (grpc.aio.AioRpcError, grpc.aio.UsageError) as e:
                log.debug("kv-store at %s: Release of an unanswered pin failed (%s)", self.address, e)
                return
            if reply.valid:               # without slots: the pin was live, and is now ended
                self.num_unanswered_pins_released += 1
        task = asyncio.get_running_loop().create_task(release())
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _release_call(self, request: kv_store_pb2.ReleaseRequest) -> kv_store_pb2.ReleaseResponse:
        """Release, sent a second time when the first got no answer: a process stopped
        (SIGSTOP) right after it made the call resumes past its deadline without having
        sent it, and the pin would hold its blocks for the rest of its lease. Ending a pin
        twice is harmless; the second answer of a read's release is then "not valid" (a
        miss), never a valid read that was not."""
        try:
            return await self.stub.Release(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as e:
            # only a name of ours: a store-chosen id ("s1-pin-7") may be another reader's
            # pin after a store restart
            if e.code() not in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE) \
                    or not NAME.fullmatch(request.pin_id):
                raise
        return await self.stub.Release(request, timeout=self.timeout_s)

    def _time_left(self, expires_at: float) -> float:
        """The timeout for a transfer under a lease ending at expires_at (the call returns
        within twice that); 0: too little of the lease is left to start one."""
        left = expires_at - time.monotonic()
        return min(self.timeouts.transfer_s, left / 2) if left > self.timeouts.transfer_bound_s else 0.0

    def _under_lease(self, expires_at: float, move) -> int:
        """On an executor thread: move(timeout_s) with the timeout taken when it starts (the
        executor may have queued it), ValueError (nothing moved) when too little of the
        lease is left by then."""
        timeout_s = self._time_left(expires_at)
        if timeout_s <= 0:
            raise ValueError("too little of the lease was left when the transfer could start")
        return move(timeout_s)

    async def fetch(self, pinned: Pinned, first: int, last: int, block_ids: Sequence[int]) -> bool:
        """Read pinned slots [first, last) into the local blocks block_ids; False on failure
        (or too little of the pin's lease left to start). Valid only if release() says so."""
        if self._time_left(pinned.expires_at) <= 0:
            return False
        src, dst = pinned.slot_ids[first:last], list(block_ids)
        try:
            await asyncio.get_running_loop().run_in_executor(
                self.executor, self._under_lease, pinned.expires_at, lambda timeout_s: self.sender.fetch_blocks(
                    pinned.endpoint, pinned.layout, src, dst, timeout_s=timeout_s))
        except (TransferError, ValueError) as e:
            self._failed("read", e)
            pinned.unsettled = pinned.unsettled or getattr(e, "unsettled", False)
            return False
        self.num_loaded_blocks += last - first
        return True

    async def release(self, pinned: Pinned) -> bool:
        """End the pin; True when its slots held the pinned blocks throughout (the store
        checked their generations), so what was read from them is valid."""
        try:
            reply = await self._release_call(kv_store_pb2.ReleaseRequest(
                pin_id=pinned.pin_id, slot_ids=pinned.slot_ids, generations=pinned.generations))
        except (grpc.aio.AioRpcError, grpc.aio.UsageError) as e:   # UsageError: closed meanwhile
            self._failed("Release", e)  # the pin's lease ends it anyway
            return False
        if not reply.valid:
            log.info("kv-store pin %s lapsed or its slots were reused during the read: a miss",
                     pinned.pin_id)
        return reply.valid

    # ---- put ----------------------------------------------------------------------
    async def put(self, block_ids: Sequence[int], hashes: Sequence[bytes], token_ids: Sequence[int]) -> int:
        """Store the local blocks (one per hash, token_ids block_size each) the store does not
        hold yet; returns how many were written and committed (0 on failure)."""
        if not hashes:
            return 0
        asked = time.monotonic()
        try:
            reply = await self.stub.ReservePut(kv_store_pb2.ReservePutRequest(
                space=self.space, block_hashes=hashes, token_ids=token_ids), timeout=self.timeout_s)
            if not reply.put_id:
                self._ok()
                return 0
            layout = self._region_usable(reply.region)
            expires_at = asked + reply.lease_seconds
            if layout is None or self._time_left(expires_at) <= 0:
                return 0  # the reservation expires
            src, dst = [block_ids[i] for i in reply.indices], list(reply.slot_ids)
            try:
                await asyncio.get_running_loop().run_in_executor(
                    self.executor, self._under_lease, expires_at, lambda timeout_s: self.sender.send_blocks(
                        reply.region.transfer_endpoint, layout, src, dst, timeout_s=timeout_s))
            except (TransferError, ValueError) as e:
                self._failed("write", e)
                return 0
            done = await self.stub.CommitPut(kv_store_pb2.CommitPutRequest(put_id=reply.put_id),
                                             timeout=self.timeout_s)
        except grpc.aio.AioRpcError as e:
            self._failed("put", e)
            return 0
        self._ok()
        self.num_put_blocks += done.num_committed
        return done.num_committed

    async def lookup(self, hashes: Sequence[bytes]) -> int:
        """Leading hits (memory or Redis); 0 on failure."""
        try:
            reply = await self.stub.Lookup(kv_store_pb2.LookupRequest(
                space=self.space, block_hashes=hashes), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as e:
            self._failed("Lookup", e)
            return 0
        self._ok()
        return reply.num_hits

    async def close(self) -> None:
        self._closed = True
        if self._releases:             # a release may be sent twice
            await asyncio.wait(list(self._releases), timeout=2 * self.timeout_s)
        await self._channel.close()
