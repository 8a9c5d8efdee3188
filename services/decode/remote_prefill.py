"""The decode node's side of one disaggregated prefill (the RemotePrefill protocol of
common/engine/async_engine.py): call the prefill node's Prefill with this node's
destination blocks, or cancel it so that no write lands after our blocks are freed."""
from __future__ import annotations

import logging

import grpc

from protos.pdmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from services.engine_node import EngineNode

log = logging.getLogger("pdmesh.decode")


class RemotePrefillCall:
    def __init__(self, node: EngineNode, request_id: str, prompt: list[int],
                 sampling: common_pb2.SamplingParams, prefill: common_pb2.NodeInfo, timeout_s: float):
        self.node, self.request_id, self.prompt = node, request_id, prompt
        self.sampling, self.prefill, self.timeout_s = sampling, prefill, timeout_s
        self.reply: engine_pb2.PrefillResponse | None = None
        self._call = None

    async def run(self, block_ids: list[int], num_cached_tokens: int) -> int:
        dest = engine_pb2.KVDestination(
            node_id=self.node.node.node_id, transfer_endpoint=self.node.transfer.endpoint,
            layout=self.node.layout.to_proto(), block_ids=block_ids,
            num_cached_tokens=num_cached_tokens)
        stub = engine_pb2_grpc.PrefillStub(self.node.channel(self.prefill.address))
        self._call = stub.Prefill(engine_pb2.PrefillRequest(
            request_id=self.request_id, prompt_token_ids=self.prompt, sampling=self.sampling,
            destination=dest), timeout=self.timeout_s)
        self.reply = await self._call
        return self.reply.first_token_id

    async def cancel(self) -> None:
        """Ask the prefill node to stop writing and wait until it has; then drop the call."""
        stub = engine_pb2_grpc.PrefillStub(self.node.channel(self.prefill.address))
        try:
            await stub.CancelPrefill(engine_pb2.CancelPrefillRequest(request_id=self.request_id), timeout=5)
        except grpc.aio.AioRpcError as e:
            log.info("CancelPrefill of %s on %s: %s", self.request_id, self.prefill.node_id, e.code().name)
        finally:
            if self._call is not None:
                self._call.cancel()
