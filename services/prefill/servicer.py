"""Prefill servicer.

Lifecycle of a Prefill RPC on this node (the request's states: common/engine/lifecycle.py):
  validate (prompt, sampling, destination layout and block count)
  -> the destination is what a live decode node registered (services/prefill/
     destination_check.py), else PERMISSION_DENIED / INVALID_ARGUMENT (nothing written)
  -> this node's ranks can write into its ranks (tensor-parallel sizes and heads:
     services/prefill/kv_destination.py), else FAILED_PRECONDITION (nothing written)
  -> max_queue requests waiting already? RESOURCE_EXHAUSTED at once (nothing written)
  -> admitted: blocks allocated, own prefix-cache hits first, then (with a kv-store) the
     store's further hits read into them (services/prefill/store_prefix.py)
  -> queued in the engine (batched with other prefills, chunked) for the rest
  -> after each chunk, its complete blocks are written into the destination (blocks
     hit or read from the store go with the first chunk); no write starts past the
     call's deadline
  -> first token sampled -> wait for every write's acknowledgement -> reply
  -> in the background: new full blocks put to the kv-store, then the blocks released
     (they stay in the prefix cache).
Every status this node answers itself is sent after the request's writes ended and carries
the trailing metadata `pdmesh-writes-settled`; so the decode node knows it may reuse its
blocks. CancelPrefill (by the mesh's request id) stops new writes and answers once those in
flight ended (settled), or after timeouts.transfer_s with some still in flight (not
settled: the decode node keeps its blocks quarantined and asks again). The source blocks
are released only after every write of theirs ended. On shutdown, drain() first stops
and waits for every write, so that once the port refuses connections none can land.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import OrderedDict

import grpc

from common.call_metadata import WRITES_SETTLED_KEY
from common.timeline import mark
from common.engine.async_engine import EngineDeadError
from common.transfer.base import TransferError
from common.kv_layout import KVLayout
from protos.pdmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from common.engine.validation import validate_resume_position
from services.convert import logprobs_to_proto, sampling_from_proto
from services.node.members_view import MembersView
from services.prefill.destination_check import DestinationCheck, DestinationRefused
from services.security.server_auth import peer_service_name
from services.prefill.kv_destination import destination_writes
from services.prefill.kv_push import KVPusher
from services.prefill.store_prefix import StorePrefix

log = logging.getLogger("pdmesh.prefill")
SETTLED = ((WRITES_SETTLED_KEY, "1"),)
MAX_REMEMBERED = 4096   # unsettled requests and cancelled ids remembered (oldest dropped)


class PrefillServicer(engine_pb2_grpc.PrefillServicer):
    def __init__(self, node, members: MembersView | None = None):
        """node: an EngineNode (engine, sender, executor, layout, kv_store, node, mesh).
        members: the mesh's live members that destinations are checked against (default:
        the meta-servers' list, MembersView.for_mesh(node.mesh)); closed by drain()."""
        self.node = node
        self.members = members if members is not None else MembersView.for_mesh(node.mesh)
        self.destinations = DestinationCheck(self.members)
        self.inflight: dict[str, tuple[KVPusher, StorePrefix | None]] = {}
        # ended with writes possibly in flight, until its pusher is settled
        self.unsettled: OrderedDict[str, KVPusher] = OrderedDict()
        self.cancelled: OrderedDict[str, None] = OrderedDict()   # refused if they arrive later
        self._releases: set[asyncio.Task] = set()
        self.closing = False

    def _check(self, request) -> tuple[list[int], object]:
        """ValueError naming the field when the request cannot be served."""
        engine = self.node.engine
        prompt, dest = list(request.prompt_token_ids), request.destination
        params = dataclasses.replace(sampling_from_proto(request.sampling), max_tokens=1, stop=[])
        engine.validate(request.request_id, prompt, params)
        validate_resume_position(request.resume_position, len(prompt))
        dst_layout = KVLayout.from_proto(dest.layout)
        self.node.layout.check_compatible(dst_layout, same_heads=False)   # heads: by rank pairing
        need = engine.num_blocks_for(len(prompt))
        if len(dest.block_ids) != need:
            raise ValueError(f"destination.block_ids has {len(dest.block_ids)} ids; the "
                             f"{len(prompt)}-token prompt needs {need}")
        if not 0 <= dest.num_cached_tokens < len(prompt):
            raise ValueError(f"destination.num_cached_tokens must be in [0, {len(prompt)}), "
                             f"got {dest.num_cached_tokens}")
        return prompt, params

    async def Prefill(self, request, context):
        rid, dest = request.request_id, request.destination
        mark("prefill.in", rid)
        engine = self.node.engine
        caller = peer_service_name(context)
        if caller is not None and caller != dest.node_id:   # mTLS: a node names only itself
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                "destination.node_id must be the calling node's own", trailing_metadata=SETTLED)
        try:
            prompt, params = self._check(request)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e), trailing_metadata=SETTLED)
        try:
            checked = await self.destinations.check(dest)
        except DestinationRefused as e:
            log.warning("refused the destination of %s: %s", rid, e)
            await context.abort(e.code, str(e), trailing_metadata=SETTLED)
        try:
            writes = destination_writes(self.node.sender, self.node.rank_writers, self.node.rank_layouts,
                                        checked.ranks, self.node.staging)
        except ValueError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"prefill node {self.node.node.node_id} cannot push into {dest.node_id}: {e}",
                                trailing_metadata=SETTLED)
        if self.closing:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"prefill node {self.node.node.node_id} is shutting down",
                                trailing_metadata=SETTLED)
        if rid in self.cancelled:  # its cancel overtook it
            await context.abort(grpc.StatusCode.CANCELLED, f"prefill of {rid} was cancelled",
                                trailing_metadata=SETTLED)
        if engine.num_waiting() >= self.node.node.max_queue:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"prefill node {self.node.node.node_id} has {self.node.node.max_queue} "
                                "requests waiting", trailing_metadata=SETTLED)
        timeouts = self.node.mesh.timeouts
        remaining = context.time_remaining()
        deadline = time.monotonic() + (timeouts.prefill_s if remaining is None else remaining)
        pusher = KVPusher(writes, self.node.executor, list(checked.block_ids), checked.num_cached_tokens, engine.block_size, len(prompt),
                          deadline, timeouts.transfer_s,
                          layerwise=self.node.mesh.transfer.kv_push == "layerwise")
        store = None
        if self.node.kv_store is not None:
            store = StorePrefix(self.node.kv_store, prompt, engine.model_id, engine.layout_key)
        self.inflight[rid] = (pusher, store)
        start = time.perf_counter()
        mark("prefill.start", rid)
        finished = False
        failure: tuple[grpc.StatusCode, str] | None = None
        try:
            out = await engine.prefill(rid, prompt, params, on_computed=pusher.on_computed, remote=store,
                                       resume_position=request.resume_position)
            if out.finish_reason == "abort" or not out.new_token_ids:  # CancelPrefill meanwhile
                failure = (grpc.StatusCode.CANCELLED, f"prefill of {rid} was cancelled")
            else:
                computed = time.perf_counter()
                mark("prefill.computed", rid)
                nbytes = await pusher.finish()
                done = time.perf_counter()
                finished = True
                self.node.metrics.queue_time.observe(out.queue_s)
                self.node.metrics.kv_transfer.observe(done - computed)
        except TransferError as e:
            log.warning("KV push of %s to %s failed: %s", rid, dest.transfer_endpoint, e)
            failure = (grpc.StatusCode.UNAVAILABLE, f"KV transfer to {dest.node_id} failed: {e}")
        except EngineDeadError as e:
            failure = (grpc.StatusCode.UNAVAILABLE, f"prefill node engine failed: {e}")
        finally:
            self.inflight.pop(rid, None)
            if not finished:  # until its writes ended, CancelPrefill answers from this record
                self._remember_unsettled(rid, pusher)
                stopping = asyncio.ensure_future(pusher.stop())
            self._release_later(rid, store, pusher, finished)
        if failure is not None:
            settled = await stopping
            await context.abort(*failure, trailing_metadata=SETTLED if settled else ())
        timing = common_pb2.PrefillTiming(
            remote=True, queue_ms=out.queue_s * 1e3, compute_ms=(computed - start - out.queue_s) * 1e3,
            transfer_ms=(done - computed) * 1e3)
        mark("prefill.answered", rid)
        reply = engine_pb2.PrefillResponse(first_token_id=out.new_token_ids[0],
                                           num_cached_tokens=out.num_cached_tokens,
                                           timing=timing, bytes_written=nbytes)
        if out.new_logprobs:
            reply.first_token_logprobs.CopyFrom(logprobs_to_proto(out.new_logprobs[0]))
        return reply

    def _remember_unsettled(self, request_id: str, pusher: KVPusher) -> None:
        """A write of this request may land until its pusher is settled (every write call
        returned): kept until then, not for a time, because this process may be stopped
        (SIGSTOP) past any deadline and resume the write calls it was in."""
        pusher.stopped = True   # at once: no queued write may start from now on
        self.unsettled[request_id] = pusher
        while len(self.unsettled) > MAX_REMEMBERED:   # settled ones first
            old = next((rid for rid, p in self.unsettled.items() if p.settled), None)
            if old is None:
                old, _ = self.unsettled.popitem(last=False)
                log.error("forgetting the unsettled KV push of %s (%d remembered): a CancelPrefill of it "
                          "would now answer settled", old, MAX_REMEMBERED)
            else:
                del self.unsettled[old]

    def _unsettled_pusher(self, request_id: str) -> KVPusher | None:
        pusher = self.unsettled.get(request_id)
        if pusher is not None and pusher.settled:
            del self.unsettled[request_id]
            return None
        return pusher

    def _release_later(self, request_id: str, store: StorePrefix | None, pusher: KVPusher,
                       finished: bool) -> None:
        """Off the reply's critical path: once every write ended, put the blocks to the
        kv-store (when the prefill finished), then free them. Kept referenced until done."""
        task = asyncio.get_running_loop().create_task(self._put_and_release(request_id, store, pusher, finished))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _put_and_release(self, request_id: str, store: StorePrefix | None, pusher: KVPusher,
                               finished: bool) -> None:
        try:
            await pusher.settle()  # the writes read these blocks: none may be reused before
            if store is not None:
                await store.finish(put=finished)
        finally:
            if pusher.settled and self.unsettled.get(request_id) is pusher:
                del self.unsettled[request_id]
            try:
                await self.node.engine.release(request_id)
            except EngineDeadError:
                pass  # shutting down: the blocks go with the engine

    async def CancelPrefill(self, request, context):
        """Answers once the writes have ended (or the wait for them timed out); stopping
        the prefill itself (kv-store read, engine abort) goes on in the background."""
        rid = request.request_id
        entry = self.inflight.get(rid)
        if entry is None:
            self.cancelled[rid] = None
            _bound(self.cancelled)
            pusher = self._unsettled_pusher(rid)
            settled = pusher is None or await pusher.stop()
            return engine_pb2.CancelPrefillResponse(was_running=False, settled=settled)
        pusher, store = entry
        settled = await pusher.stop()
        task = asyncio.get_running_loop().create_task(self._abort(rid, store))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)
        return engine_pb2.CancelPrefillResponse(was_running=True, settled=settled)

    async def _abort(self, request_id: str, store: StorePrefix | None) -> None:
        if store is not None:
            await store.cancel()  # no store read may land in blocks the abort frees
        try:
            await self.node.engine.abort(request_id)
        except EngineDeadError:
            pass

    async def drain(self, timeout_s: float) -> bool:
        """Before the server stops (its port then refuses connections, which decode nodes
        take as "this process writes no more"): refuse new prefills, start no more writes,
        and wait up to timeout_s for those in flight to end. True when all ended."""
        self.closing = True
        pushers = [p for p, _ in self.inflight.values()] + list(self.unsettled.values())
        for pusher in pushers:
            pusher.stopped = True
        pending = [w for p in pushers for w in p.writes if not w.done()]
        if pending:
            await asyncio.wait(pending, timeout=timeout_s)
        settled = all(p.settled for p in pushers)
        if not settled:
            log.warning("%s: stopping with KV writes still in flight", self.node.node.node_id)
        await self.members.close()
        return settled

    async def GetEngineStats(self, request, context):
        return await self.node.engine_stats(pending_transfers=len(self.inflight))


def _bound(records: OrderedDict) -> None:
    while len(records) > MAX_REMEMBERED:
        records.popitem(last=False)
