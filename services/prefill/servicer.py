"""Prefill servicer.

Lifecycle of a Prefill RPC on this node:
  validate (prompt, sampling, destination layout and block count)
  -> admitted: blocks allocated, own prefix-cache hits first, then (with a kv-store) the
     store's further hits read into them (services/prefill/store_prefix.py)
  -> queued in the engine (batched with other prefills, chunked) for the rest
  -> after each chunk, its complete blocks are written into the destination (blocks
     hit or read from the store go with the first chunk)
  -> first token sampled -> wait for every write's acknowledgement -> reply
  -> in the background: new full blocks put to the kv-store, then the blocks released
     (they stay in the prefix cache).
CancelPrefill (or the caller cancelling) stops new writes and returns only once the
writes in flight are done, so the decode node can reuse its blocks safely.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import grpc

from common.engine.async_engine import EngineDeadError
from common.transfer.base import TransferError
from common.transfer.layout import KVLayout
from protos.pdmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from services.convert import sampling_from_proto
from services.engine_node import EngineNode
from services.prefill.kv_push import KVPusher
from services.prefill.store_prefix import StorePrefix
from services.prefill.stream import serve_prefill_stream

log = logging.getLogger("pdmesh.prefill")


class PrefillServicer(engine_pb2_grpc.PrefillServicer):
    def __init__(self, node: EngineNode):
        self.node = node
        self.inflight: dict[str, tuple[KVPusher, StorePrefix | None]] = {}
        self._releases: set[asyncio.Task] = set()

    async def Prefill(self, request, context):
        rid, prompt = request.request_id, list(request.prompt_token_ids)
        dest = request.destination
        engine = self.node.llm_engine
        try:
            params = dataclasses.replace(sampling_from_proto(request.sampling), max_tokens=1,
                                         stop=[])
            engine.validate_request(rid, prompt, params)
            dst_layout = KVLayout.from_proto(dest.layout)
            self.node.layout.check_compatible(dst_layout)
            need = engine.block_manager.num_blocks_for(len(prompt))
            if len(dest.block_ids) != need:
                raise ValueError(f"destination.block_ids has {len(dest.block_ids)} ids; the "
                                 f"{len(prompt)}-token prompt needs {need}")
            if not 0 <= dest.num_cached_tokens < len(prompt):
                raise ValueError(f"destination.num_cached_tokens must be in [0, {len(prompt)}), "
                                 f"got {dest.num_cached_tokens}")
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        pusher = KVPusher(self.node.sender, self.node.executor, dest.transfer_endpoint, dst_layout,
                          list(dest.block_ids), dest.num_cached_tokens, engine.block_size, len(prompt))
        store = None
        if self.node.kv_store is not None:
            store = StorePrefix(self.node.kv_store, prompt, engine.model_id, engine.layout)
        self.inflight[rid] = (pusher, store)
        start = time.perf_counter()
        finished = False
        try:
            out = await self.node.engine.prefill(rid, prompt, params, on_computed=pusher.on_computed,
                                                 external=store)
            # aborted meanwhile (CancelPrefill): its blocks are freed; nothing to finish or put
            cancelled = out.finish_reason == "abort" or not out.new_token_ids
            if not cancelled:
                computed = time.perf_counter()
                nbytes = await pusher.finish()
                done = time.perf_counter()
                finished = True
        except TransferError as e:
            log.warning("KV push of %s to %s failed: %s", rid, dest.transfer_endpoint, e)
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"KV transfer to {dest.node_id} ({dest.transfer_endpoint}) failed: {e}")
        finally:
            if not finished:
                await asyncio.shield(pusher.stop())
            self.inflight.pop(rid, None)
            self._release_later(rid, store, finished)
        if not finished:
            await context.abort(grpc.StatusCode.CANCELLED, f"prefill of {rid} was cancelled")
        timing = common_pb2.PrefillTiming(remote=True, 
            queue_ms=out.queue_s * 1e3, compute_ms=(computed - start - out.queue_s) * 1e3,
            transfer_ms=(done - computed) * 1e3)
        return engine_pb2.PrefillResponse(first_token_id=out.new_token_ids[0],
                                          num_cached_tokens=out.num_cached_tokens,
                                          timing=timing, bytes_written=nbytes)

    def _release_later(self, request_id: str, store: StorePrefix | None, finished: bool) -> None:
        """Off the reply's critical path: put the blocks to the kv-store (when the prefill
        finished), then free them. The task is kept referenced until it is done."""
        task = asyncio.get_running_loop().create_task(self._put_and_release(request_id, store, finished))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _put_and_release(self, request_id: str, store: StorePrefix | None, finished: bool) -> None:
        try:
            if store is not None:
                await store.finish(put=finished)
        finally:
            try:
                await self.node.engine.release(request_id)
            except EngineDeadError:
                pass  # shutting down: the blocks go with the engine

    async def CancelPrefill(self, request, context):
        entry = self.inflight.get(request.request_id)
        if entry is None:
            return engine_pb2.CancelPrefillResponse(was_running=False)
        pusher, store = entry
        await pusher.stop()
        if store is not None:
            await store.cancel()  # no store read may land in blocks the abort frees
        await self.node.engine.abort(request.request_id)
        return engine_pb2.CancelPrefillResponse(was_running=True)

    async def stop_writes(self, request_id: str) -> bool:
        """Stop a running prefill's KV writes (and kv-store reads) and return once none
        can land any more; the prefill itself goes on until its caller cancels it. False
        if it is not running."""
        entry = self.inflight.get(request_id)
        if entry is None:
            return False
        pusher, store = entry
        await pusher.stop()
        if store is not None:
            await store.cancel()
        return True

    async def PrefillStream(self, request_iterator, context):
        """Prefill and CancelPrefill calls of one decode node over one stream."""
        await serve_prefill_stream(self, request_iterator, context)

    async def GetEngineStats(self, request, context):
        return self.node.engine_stats(pending_transfers=len(self.inflight))
