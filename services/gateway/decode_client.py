"""The gateway's calls to decode nodes: one plain server-streaming Generate per request
attempt, on one long-lived channel per decode node (HTTP/2 multiplexes the calls; a
call's deadline, cancellation and error are its own).

    call = decode.generate(address, DecodeRequest(...), timeout_s)
    async for msg in call: ...       # DecodeResponse
    call.cancel()                    # leave it: the decode node aborts the request

Back-pressure: at most MAX_CALLS_PER_PEER calls in flight to one decode node; past that
the call fails at once with RESOURCE_EXHAUSTED. Thread-safety: event loop only.
"""
from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.pdmesh.v1 import engine_pb2, engine_pb2_grpc
from services.node import grpc_util


class DecodeCall:
    """One Generate call; async-iterate it for DecodeResponses."""

    def __init__(self, client: "DecodeClient", address: str, request: engine_pb2.DecodeRequest,
                 timeout_s: float):
        self._client, self._address = client, address
        self._request, self._timeout_s = request, timeout_s
        self._call = None
        self._messages = None
        self._slot = None

    def __aiter__(self):
        return self

    async def __anext__(self) -> engine_pb2.DecodeResponse:
        if self._call is None:
            self._slot = self._client.limits.acquire(self._address)   # raises RESOURCE_EXHAUSTED
            self._call = self._client.stub(self._address).Generate(self._request, timeout=self._timeout_s)
            self._messages = self._call.__aiter__()
        try:
            return await self._messages.__anext__()
        except (StopAsyncIteration, grpc.aio.AioRpcError):
            self._release()
            raise

    def cancel(self) -> None:
        if self._call is not None:
            self._call.cancel()
        self._release()

    def _release(self) -> None:
        slot, self._slot = self._slot, None
        if slot is not None:
            slot.release()


class DecodeClient:
    def __init__(self, max_calls_per_peer: int = grpc_util.MAX_CALLS_PER_PEER):
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, engine_pb2_grpc.DecodeStub] = {}
        self.limits = grpc_util.PeerLimits(max_calls_per_peer)

    def stub(self, address: str) -> engine_pb2_grpc.DecodeStub:
        stub = self._stubs.get(address)
        if stub is None:
            self._channels[address] = grpc_util.channel(address)
            stub = self._stubs[address] = engine_pb2_grpc.DecodeStub(self._channels[address])
        return stub

    async def serving(self, address: str, timeout_s: float) -> bool:
        """Whether the node at address answers SERVING to grpc.health within timeout_s."""
        self.stub(address)
        try:
            reply = await health_pb2_grpc.HealthStub(self._channels[address]).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def generate(self, address: str, request: engine_pb2.DecodeRequest, timeout_s: float) -> DecodeCall:
        return DecodeCall(self, address, request, timeout_s)

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
