"""The gateway's calls to decode nodes: Generate over one long-lived GenerateStream per
decode node (services/call_stream), which saves a new RPC's setup on every request.

    call = decode.generate(address, DecodeRequest(...), timeout_s)
    async for msg in call: ...       # DecodeResponse, as from the unary-stream Generate
    call.cancel()                    # leave it: the decode node aborts the request

Errors are grpc.aio.AioRpcError with Generate's status codes; a broken stream fails each
of its calls with UNAVAILABLE (the next call opens a new one). A decode node that does
not serve GenerateStream (UNIMPLEMENTED) is called with the unary-stream Generate from
then on. Thread-safety: event loop only.
"""
from __future__ import annotations

import grpc

from protos.pdmesh.v1 import engine_pb2, engine_pb2_grpc
from services import grpc_util
from services.call_stream import CallStreamClient


class DecodeCall:
    """One Generate call; async-iterate it for DecodeResponses."""

    def __init__(self, client: "DecodeClient", address: str, request: engine_pb2.DecodeRequest,
                 timeout_s: float):
        self._client, self._address, self._request, self._timeout_s = client, address, request, timeout_s
        self._call = None
        self._messages = None
        self._streamed = False
        self._received = False

    def _start(self) -> None:
        self._streamed = self._address not in self._client.unary_only
        if not self._streamed:
            self._call = self._client.stub(self._address).Generate(self._request, timeout=self._timeout_s)
            self._messages = self._call.__aiter__()
        else:
            self._call = self._client.stream(self._address).open(
                engine_pb2.GenerateStreamRequest(generate=self._request), timeout=self._timeout_s)
            self._messages = self._call

    def __aiter__(self):
        return self

    async def __anext__(self) -> engine_pb2.DecodeResponse:
        if self._call is None:
            self._start()
        try:
            msg = await self._messages.__anext__()
        except grpc.aio.AioRpcError as e:
            if not (self._streamed and not self._received and e.code() == grpc.StatusCode.UNIMPLEMENTED):
                raise
            self._client.unary_only.add(self._address)
            self._start()
            msg = await self._messages.__anext__()
        self._received = True
        return msg.response if self._streamed else msg

    def cancel(self) -> None:
        if self._call is not None:
            self._call.cancel()


class DecodeClient:
    def __init__(self):
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, engine_pb2_grpc.DecodeStub] = {}
        self._streams: dict[str, CallStreamClient] = {}
        self.unary_only: set[str] = set()

    def stub(self, address: str) -> engine_pb2_grpc.DecodeStub:
        stub = self._stubs.get(address)
        if stub is None:
            self._channels[address] = grpc_util.channel(address)
            stub = self._stubs[address] = engine_pb2_grpc.DecodeStub(self._channels[address])
        return stub

    def stream(self, address: str) -> CallStreamClient:
        stream = self._streams.get(address)
        if stream is None:
            stream = self._streams[address] = CallStreamClient(self.stub(address).GenerateStream)
        return stream

    def generate(self, address: str, request: engine_pb2.DecodeRequest, timeout_s: float) -> DecodeCall:
        return DecodeCall(self, address, request, timeout_s)

    async def close(self) -> None:
        for stream in self._streams.values():
            await stream.close()
        for ch in self._channels.values():
            await ch.close()
