"""The gateway's view of the meta-servers: one or more addresses, following the leader.

A call goes to the meta-server that answered last. When it is unreachable, or answers
FAILED_PRECONDITION (a standby: only the leader routes), the next address is tried, in
turn, until `follow_timeout_s` has passed: a standby that takes over within one TTL is
found without the request failing. An application answer (e.g. UNAVAILABLE "no live
decode node") is returned as is.
"""
from __future__ import annotations

import asyncio
import time

import grpc

from protos.pdmesh.v1 import meta_pb2_grpc
from services import grpc_util

NO_NODE_PREFIX = "no live"


class MetaClient:
    def __init__(self, addresses: list[str], follow_timeout_s: float = 8.0):
        if not addresses:
            raise ValueError("at least one meta-server address is required")
        self.addresses = list(addresses)
        self.follow_timeout_s = follow_timeout_s
        self._channels = [grpc_util.channel(a) for a in self.addresses]
        self._current = 0

    @property
    def current_address(self) -> str:
        return self.addresses[self._current]

    async def call(self, method: str, request, timeout: float = 5.0):
        deadline = time.monotonic() + self.follow_timeout_s
        while True:
            stub = meta_pb2_grpc.MetaServerStub(self._channels[self._current])
            try:
                return await getattr(stub, method)(request, timeout=timeout)
            except grpc.aio.AioRpcError as e:
                answered = e.code() == grpc.StatusCode.UNAVAILABLE and e.details().startswith(NO_NODE_PREFIX)
                follow = e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION,
                                      grpc.StatusCode.DEADLINE_EXCEEDED)
                if answered or not follow or time.monotonic() > deadline:
                    raise
            self._current = (self._current + 1) % len(self.addresses)
            if self._current == 0:
                await asyncio.sleep(0.1)

    async def close(self) -> None:
        for ch in self._channels:
            await ch.close()
