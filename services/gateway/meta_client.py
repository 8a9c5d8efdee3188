"""The gateway's view of the meta-servers: one or more addresses, following the leader.

A call goes to the meta-server that answered last. When it is unreachable, or answers
FAILED_PRECONDITION (a standby: only the leader routes), the next address is tried, in
turn, until `follow_timeout_s` has passed: a standby that takes over within one TTL is
found without the request failing. An application answer (e.g. UNAVAILABLE "no live
decode node") is returned as is.

`route` sends Route over one long-lived RouteStream per meta-server (saving a unary
call's setup on every request), with the same following: a call the stream answers
FAILED_PRECONDITION moves on to the next address, a broken stream fails its open calls
with UNAVAILABLE (they move on too) and is opened again at the next call to that
address, a stream silent past the timeout is dropped. A meta-server that does not
serve RouteStream (UNIMPLEMENTED) is asked with the unary Route from then on.

Thread-safety: event loop only.
"""
from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable

import grpc

from protos.pdmesh.v1 import meta_pb2, meta_pb2_grpc
from services import grpc_util
from services.call_stream import CallStreamClient

NO_NODE_PREFIX = "no live"
FOLLOW = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION,
          grpc.StatusCode.DEADLINE_EXCEEDED)


class MetaClient:
    def __init__(self, addresses: list[str], follow_timeout_s: float = 8.0):
        if not addresses:
            raise ValueError("at least one meta-server address is required")
        self.addresses = list(addresses)
        self.follow_timeout_s = follow_timeout_s
        self._channels = [grpc_util.channel(a) for a in self.addresses]
        self._stubs = [meta_pb2_grpc.MetaServerStub(ch) for ch in self._channels]
        self._streams = [CallStreamClient(stub.RouteStream) for stub in self._stubs]
        self._unary_route: set[int] = set()   # addresses without RouteStream
        self._current = 0

    @property
    def current_address(self) -> str:
        return self.addresses[self._current]

    async def call(self, method: str, request, timeout: float = 5.0):
        """A unary MetaServer call, following the leader."""
        return await self._follow(lambda i: getattr(self._stubs[i], method)(request, timeout=timeout))

    async def route(self, request: meta_pb2.RouteRequest, timeout: float = 5.0) -> meta_pb2.RouteResponse:
        """Route over the current meta-server's RouteStream, following the leader; raises
        grpc.aio.AioRpcError with the unary Route's status codes."""
        async def attempt(i: int) -> meta_pb2.RouteResponse:
            if i not in self._unary_route:
                try:
                    reply = await self._streams[i].call(meta_pb2.RouteStreamRequest(route=request),
                                                        timeout=timeout)
                    return reply.route
                except grpc.aio.AioRpcError as e:
                    if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                        self._streams[i].reset()
                    if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                        raise
                    self._unary_route.add(i)
            return await self._stubs[i].Route(request, timeout=timeout)

        return await self._follow(attempt)

    async def _follow(self, attempt: Callable[[int], Awaitable]):
        deadline = time.monotonic() + self.follow_timeout_s
        while True:
            try:
                return await attempt(self._current)
            except grpc.aio.AioRpcError as e:
                answered = e.code() == grpc.StatusCode.UNAVAILABLE and e.details().startswith(NO_NODE_PREFIX)
                if answered or e.code() not in FOLLOW or time.monotonic() > deadline:
                    raise
            self._current = (self._current + 1) % len(self.addresses)
            if self._current == 0:
                await asyncio.sleep(0.1)

    async def close(self) -> None:
        for stream in self._streams:
            await stream.close()
        for ch in self._channels:
            await ch.close()
