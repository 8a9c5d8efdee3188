"""The gateway's view of the meta-servers: one or more addresses, following the leader.

A call goes to the meta-server that answered last. When it is unreachable, or answers
FAILED_PRECONDITION (a standby: only the leader routes), the next address is tried, in
turn, until `follow_timeout_s` has passed: a standby that takes over within one TTL is
found without the request failing. An application answer (e.g. UNAVAILABLE "no live
decode node") is returned as is. Calls are plain unary RPCs on one long-lived channel per
meta-server (HTTP/2 multiplexes them).

Thread-safety: event loop only.
"""
from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable

import grpc

from protos.pdmesh.v1 import meta_pb2, meta_pb2_grpc
from services.node import grpc_util

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
        self._current = 0

    @property
    def current_address(self) -> str:
        return self.addresses[self._current]

    async def call(self, method: str, request, timeout: float = 5.0, deadline: float | None = None):
        """A unary MetaServer call, following the leader for follow_timeout_s, and never
        past `deadline` (time.monotonic(), the request's) when given."""
        return await self._follow(lambda i: getattr(self._stubs[i], method)(request, timeout=timeout), deadline)

    async def route(self, request: meta_pb2.RouteRequest, timeout: float = 5.0,
                    deadline: float | None = None) -> meta_pb2.RouteResponse:
        """Route, following the leader; raises grpc.aio.AioRpcError."""
        return await self.call("Route", request, timeout, deadline)

    async def _follow(self, attempt: Callable[[int], Awaitable], deadline: float | None = None):
        deadline = min(time.monotonic() + self.follow_timeout_s, deadline or float("inf"))
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
        for ch in self._channels:
            await ch.close()
