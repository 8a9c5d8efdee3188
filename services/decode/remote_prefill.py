"""The decode node's side of one disaggregated prefill (the RemotePrefill protocol of
common/engine/async_engine.py): have the prefill node fill this node's destination
blocks, or cancel it so that no write lands after our blocks are freed.

Calls go over one PrefillStream per prefill node (services/prefill/stream.py), shared
by every request (PrefillStreams); a prefill node that does not serve it (UNIMPLEMENTED)
gets the unary Prefill / CancelPrefill from then on.

Lifecycle of one call: run() sends the prefill and returns its first token (raises when
it failed: the engine then prefills locally) -> or cancel(), at any point: before run()
sent anything, run() will not send; afterwards the prefill is cancelled on its node and
cancel() returns once that node has answered that none of its writes can land any more
(or the stream to it broke: the node is gone or stops the prefill itself). run() then
raises CancelledError.
"""
from __future__ import annotations

import asyncio
import logging

import grpc

from protos.pdmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from services.call_stream import CallStreamClient
from services.engine_node import EngineNode

log = logging.getLogger("pdmesh.decode")
CANCEL_TIMEOUT_S = 5.0


class PrefillStreams:
    """One PrefillStream client per prefill node address (event loop only)."""

    def __init__(self, node: EngineNode):
        self.node = node
        self._streams: dict[str, CallStreamClient] = {}
        self.unary_only: set[str] = set()

    def get(self, address: str) -> CallStreamClient:
        stream = self._streams.get(address)
        if stream is None:
            stub = engine_pb2_grpc.PrefillStub(self.node.channel(address))
            stream = self._streams[address] = CallStreamClient(stub.PrefillStream)
        return stream

    async def close(self) -> None:
        for stream in self._streams.values():
            await stream.close()


class RemotePrefillCall:
    def __init__(self, node: EngineNode, request_id: str, prompt: list[int],
                 sampling: common_pb2.SamplingParams, prefill: common_pb2.NodeInfo, timeout_s: float,
                 streams: PrefillStreams):
        self.node, self.request_id, self.prompt = node, request_id, prompt
        self.sampling, self.prefill, self.timeout_s = sampling, prefill, timeout_s
        self.streams = streams
        self.reply: engine_pb2.PrefillResponse | None = None
        self._call = None            # the unary Prefill call
        self._call_id = 0            # the call on the stream
        self._cancelled = False

    async def run(self, block_ids: list[int], num_cached_tokens: int) -> int:
        if self._cancelled:
            raise asyncio.CancelledError()
        dest = engine_pb2.KVDestination(
            node_id=self.node.node.node_id, transfer_endpoint=self.node.transfer.endpoint,
            layout=self.node.layout.to_proto(), block_ids=block_ids,
            num_cached_tokens=num_cached_tokens)
        request = engine_pb2.PrefillRequest(request_id=self.request_id, prompt_token_ids=self.prompt,
                                            sampling=self.sampling, destination=dest)
        address = self.prefill.address
        if address not in self.streams.unary_only:
            stream = self.streams.get(address)
            self._call_id = stream.next_call_id()
            try:
                answer = await stream.call(engine_pb2.PrefillStreamRequest(
                    call_id=self._call_id, prefill=request), timeout=self.timeout_s)
                self.reply = answer.prefill
                return self.reply.first_token_id
            except grpc.aio.AioRpcError as e:
                if self._cancelled:
                    raise asyncio.CancelledError() from e
                if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                self.streams.unary_only.add(address)
                self._call_id = 0
        stub = engine_pb2_grpc.PrefillStub(self.node.channel(address))
        self._call = stub.Prefill(request, timeout=self.timeout_s)
        self.reply = await self._call
        return self.reply.first_token_id

    async def cancel(self) -> None:
        """Ask the prefill node to stop writing and wait until it has; then drop the call."""
        self._cancelled = True
        if self._call_id:
            stream = self.streams.get(self.prefill.address)
            try:
                await stream.call(engine_pb2.PrefillStreamRequest(cancel_call_id=self._call_id),
                                  timeout=CANCEL_TIMEOUT_S)
            except grpc.aio.AioRpcError as e:
                log.info("cancelling the prefill of %s on %s: %s", self.request_id, self.prefill.node_id,
                         e.code().name)
                if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    stream.reset()  # silent: its calls fail, and the prefill node stops them
            return
        if self._call is None:
            return
        stub = engine_pb2_grpc.PrefillStub(self.node.channel(self.prefill.address))
        try:
            await stub.CancelPrefill(engine_pb2.CancelPrefillRequest(request_id=self.request_id),
                                     timeout=CANCEL_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            log.info("CancelPrefill of %s on %s: %s", self.request_id, self.prefill.node_id, e.code().name)
        finally:
            self._call.cancel()
