"""The decode node's side of one disaggregated prefill: the RemoteKV that
common/engine/async_engine.py drives (fill, cancel, settled).

Lifecycle of one RemotePrefill:
  fill(block_ids, n)  Prefill on the routed prefill node, then on each fallback node the
                      route listed while a node answers RESOURCE_EXHAUSTED (full: it
                      wrote nothing) or this node already has MAX_CALLS_PER_PEER calls in
                      flight to it; deadline: timeouts.prefill_s, or what remains of the
                      request if less. Returns the first token; raises otherwise (the
                      engine then calls cancel() and prefills here).
  cancel()            stop the call in flight. A status the prefill node answered itself
                      (it marks it `pdmesh-writes-settled`) proves that none of its writes
                      can land, and so does a call that never reached it (no connection):
                      True at once. Otherwise CancelPrefill(request id) on that node,
                      waiting up to timeouts.cancel_ack_s: True when it answers settled;
                      False when it does not answer or is still settling.
  settled()           after cancel() returned False: ask again every poll until the node
                      says settled, or its process is gone (its address refuses
                      connections: nobody listens there any more) for
                      timeouts.transfer_bound_s, and at the latest until the request's
                      deadline plus transfer_bound_s. Meanwhile the engine keeps the
                      destination blocks QUARANTINED. A lapsed membership lease is not
                      enough: a stopped (SIGSTOP, paused VM) process looks dead, then
                      resumes the write calls it was in and they land (the fault matrix's
                      "prefill node SIGSTOP 10 s" showed exactly that). The deadline cap
                      is a liveness trade-off: a node stopped for longer than the request's
                      whole deadline could still write into freed blocks.

The request id is the mesh's id of this attempt, so CancelPrefill can name it safely.
Thread-safety: event loop only.
"""
from __future__ import annotations

import asyncio
import logging
import time

import grpc

from common.call_metadata import WRITES_SETTLED_KEY
from common.timeline import mark
from common.engine.remote_kv import KVFilled
from protos.pdmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from services.node.grpc_util import refuses_connections
from services.convert import logprobs_from_proto

log = logging.getLogger("pdmesh.decode")
SETTLED_POLL_S = 0.5                    # settled(): how often to ask a quiet prefill node again


def answered_settled(error: grpc.aio.AioRpcError) -> bool:
    """True when the call proves no write of it can land: the prefill node itself ended it
    after its writes had ended, or it never reached the node (no connection could be made;
    gRPC core's words for that)."""
    if any(key == WRITES_SETTLED_KEY for key, _ in (error.trailing_metadata() or ())):
        return True
    return error.code() == grpc.StatusCode.UNAVAILABLE and "failed to connect" in (error.details() or "")


class RemotePrefill:
    def __init__(self, node, request: engine_pb2.DecodeRequest, deadline: float):
        """node: the decode EngineNode (channel, peer_limits, transfer, layout, mesh.timeouts);
        deadline: the request's, time.monotonic()."""
        self.node, self.request, self.deadline = node, request, deadline
        self.candidates = [request.prefill, *request.prefill_fallbacks]
        self.prefill: common_pb2.NodeInfo = request.prefill   # the node being asked
        self.reply: engine_pb2.PrefillResponse | None = None
        self.num_refused = 0                  # nodes that answered RESOURCE_EXHAUSTED
        self._call = None
        self._unsettled = False               # a call ended (or was left) with writes possibly in flight
        self._cancelled = False
        self._cancel: asyncio.Task | None = None
        self.call_deadline = 0.0              # of the last Prefill call sent

    def _stub(self, info: common_pb2.NodeInfo) -> engine_pb2_grpc.PrefillStub:
        return engine_pb2_grpc.PrefillStub(self.node.channel(info.address))

    async def fill(self, block_ids: list[int], num_cached_tokens: int) -> KVFilled:
        timeouts = self.node.mesh.timeouts
        dest = engine_pb2.KVDestination(
            node_id=self.node.node.node_id, transfer_endpoint=self.node.transfer.endpoint,
            layout=self.node.layout.to_proto(), block_ids=block_ids,
            num_cached_tokens=num_cached_tokens)
        request = engine_pb2.PrefillRequest(request_id=self.request.request_id,
                                            prompt_token_ids=self.request.prompt_token_ids,
                                            sampling=self.request.sampling, destination=dest,
                                            resume_position=self.request.resume_position)
        for info in self.candidates:
            if self._cancelled:
                raise asyncio.CancelledError()
            self.prefill = info
            timeout = min(timeouts.prefill_s, self.deadline - time.monotonic())
            if timeout <= 0:
                raise TimeoutError("the request's deadline passed before its prefill")
            self.call_deadline = time.monotonic() + timeout
            try:
                slot = self.node.peer_limits.acquire(info.address)
            except grpc.aio.AioRpcError:  # our own bound on calls to that node
                self.num_refused += 1
                continue
            self._unsettled = True
            mark("decode.prefill_sent", self.request.request_id)
            self._call = self._stub(info).Prefill(request, timeout=timeout)
            try:
                self.reply = await self._call
                mark("decode.prefill_answered", self.request.request_id)
            except grpc.aio.AioRpcError as e:
                self._unsettled = not answered_settled(e)
                if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and not self._unsettled:
                    self.num_refused += 1
                    log.info("prefill node %s is full for %s; trying the next", info.node_id,
                             self.request.request_id)
                    continue
                raise
            finally:
                slot.release()
            self._unsettled = False
            logprobs = None
            if self.reply.HasField("first_token_logprobs"):
                logprobs = logprobs_from_proto(self.reply.first_token_logprobs)
            return KVFilled(len(self.request.prompt_token_ids), self.reply.first_token_id, logprobs)
        raise RuntimeError(f"every prefill node is full ({self.num_refused} refused)")

    async def cancel(self) -> bool:
        """Idempotent: a second call returns the first one's answer."""
        self._cancelled = True
        if self._cancel is None:
            self._cancel = asyncio.ensure_future(self._stop())
        return await asyncio.shield(self._cancel)

    async def _stop(self) -> bool:
        if self._call is not None:
            self._call.cancel()
        if not self._unsettled:
            return True
        return await self._ask_settled(self.node.mesh.timeouts.cancel_ack_s)

    async def _ask_settled(self, timeout: float) -> bool:
        try:
            reply = await self._stub(self.prefill).CancelPrefill(
                engine_pb2.CancelPrefillRequest(request_id=self.request.request_id), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            log.info("CancelPrefill of %s on %s: %s", self.request.request_id, self.prefill.node_id,
                     e.code().name)
            return False
        return reply.settled

    async def settled(self) -> None:
        bound = self.node.mesh.timeouts.transfer_bound_s
        latest = self.deadline + bound
        gone_since = None
        while time.monotonic() < latest:
            if await self._ask_settled(SETTLED_POLL_S):
                return
            if await refuses_connections(self.prefill.address, SETTLED_POLL_S):
                gone_since = gone_since or time.monotonic()
                if time.monotonic() - gone_since >= bound:
                    log.warning("prefill node %s is gone: freeing the blocks of %s", self.prefill.node_id,
                                self.request.request_id)
                    return
            else:
                gone_since = None  # listening (maybe stopped): wait for its answer
            await asyncio.sleep(SETTLED_POLL_S)
        log.warning("prefill node %s never confirmed the writes of %s stopped; freeing its blocks at the "
                    "request's deadline plus %.0fs", self.prefill.node_id, self.request.request_id, bound)
