"""A real GatewayServicer and meta-server in one process over real gRPC, with fake decode
nodes (real gRPC servers) that stream a token every TOKEN_S or fail as told: the gateway's
tests (tests/unit/test_gateway_limits.py, test_node_wait.py)."""
from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from common.config import LimitsConfig, MetaConfig, PlannerConfig
from common.model.tokenizer import Tokenizer
from common.timeouts import TimeoutConfig
from protos.pdmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc, gateway_pb2, gateway_pb2_grpc, meta_pb2, meta_pb2_grpc
from services.gateway.servicer import GatewayServicer
from services.gateway.wire import add_gateway_to_server
from services.meta_server.server import create_server
from services.node import grpc_util

TOKEN_S = 0.01
MAX_MODEL_LEN = 4096
# a request with no node to route to waits this long for one (keeping off a node it failed
# on for the TTL, 60 s), then fails
NODE_WAIT_S = 0.5


class FakeDecode(engine_pb2_grpc.DecodeServicer):
    """Streams max_tokens tokens, one per TOKEN_S (the last with finish_reason "length");
    with `fail` = (code, details) it ends every call so at once instead."""

    def __init__(self, fail: tuple[grpc.StatusCode, str] | None = None, fail_calls: int | None = None):
        """fail_calls: fail only that many first calls (None: every one)."""
        self.fail, self.fail_calls = fail, fail_calls
        self.calls = 0

    async def Generate(self, request, context):
        self.calls += 1
        if self.fail is not None and (self.fail_calls is None or self.calls <= self.fail_calls):
            await context.abort(*self.fail)
        n = request.sampling.max_tokens
        for i in range(n):
            await asyncio.sleep(TOKEN_S)
            msg = engine_pb2.DecodeResponse(token_ids=[10 + i % 500])
            if i == n - 1:
                msg.finish_reason = "length"
                msg.usage.prompt_tokens, msg.usage.completion_tokens = len(request.prompt_token_ids), n
            yield msg


class Mesh:
    """A meta-server, one FakeDecode node "decode-0" (None: no node; add_decode later) and
    the gateway; register: how the gateway's handlers are registered (wire:
    add_gateway_to_server, the sizes read off the wire first; generated: gateway_pb2_grpc's,
    on the parsed message)."""

    def __init__(self, model_dir: Path, limits: LimitsConfig = LimitsConfig(),
                 decode: FakeDecode | None = None, max_model_len: int = MAX_MODEL_LEN, register: str = "wire",
                 timeouts: TimeoutConfig = TimeoutConfig(node_wait_s=NODE_WAIT_S), ttl_s: float = 60.0,
                 exclusion_lapse_s: float | None = None, planner: PlannerConfig = PlannerConfig(),
                 report_every_s: float = 0.0):
        """exclusion_lapse_s: how long a request keeps off a node it failed on (default the TTL);
        planner: the meta-server's (its timer stopped: a test ends intervals with tick());
        report_every_s: the gateway's reports to it (0 = none)."""
        self.model_dir, self.limits, self.decode_servicer = model_dir, limits, decode
        self.max_model_len, self.register, self.timeouts, self.ttl_s = max_model_len, register, timeouts, ttl_s
        self.exclusion_lapse_s = ttl_s if exclusion_lapse_s is None else exclusion_lapse_s
        self.planner, self.report_every_s = planner, report_every_s
        self.decode_servers: list[grpc.aio.Server] = []

    async def __aenter__(self) -> "Mesh":
        self.meta, self.meta_port = await create_server(MetaConfig(port=0, ttl_seconds=self.ttl_s,
                                                                   planner=self.planner))
        if self.meta.control.planner is not None:
            await self.meta.control.planner.close()
        if self.decode_servicer is not None:
            await self.add_decode(self.decode_servicer)
        self.gateway = GatewayServicer(Tokenizer.from_dir(self.model_dir), "tiny", 1024, self.max_model_len,
                                       f"127.0.0.1:{self.meta_port}", self.timeouts, limits=self.limits,
                                       membership_ttl_s=self.exclusion_lapse_s,
                                       report_every_s=self.report_every_s)
        self.server = grpc.aio.server(options=grpc_util.CHANNEL_OPTIONS)
        if self.register == "wire":
            add_gateway_to_server(self.gateway, self.server)
        else:
            gateway_pb2_grpc.add_GatewayServicer_to_server(self.gateway, self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        await self.server.start()
        self.channel = grpc.aio.insecure_channel(self.address, options=grpc_util.CHANNEL_OPTIONS)
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)
        return self

    async def add_decode(self, servicer: FakeDecode, node_id: str = "decode-0") -> None:
        """Start a decode server for servicer and register it with the meta-server."""
        server = grpc.aio.server()
        engine_pb2_grpc.add_DecodeServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        self.decode_servers.append(server)
        async with grpc_util.channel(f"127.0.0.1:{self.meta_port}") as ch:
            await meta_pb2_grpc.MetaServerStub(ch).Register(meta_pb2.RegisterRequest(
                node=common_pb2.NodeInfo(node_id=node_id, role="decode", address=f"127.0.0.1:{port}",
                                         model_id="tiny"), ttl_seconds=self.ttl_s))

    async def __aexit__(self, *exc) -> None:
        await self.channel.close()
        await self.server.stop(None)
        await self.gateway.close()
        for server in self.decode_servers:
            await server.stop(None)
        await self.meta.stop(None)
        await self.meta.close_extras()

    async def generate(self, req: gateway_pb2.GenerateRequest, timeout: float = 30) -> list:
        return [m async for m in self.stub.Generate(req, timeout=timeout)]

    async def raw(self, method: str, data: bytes) -> grpc.aio.AioRpcError:
        """Call Gateway/method with these exact request bytes; the error it fails with."""
        path = f"/pdmesh.v1.Gateway/{method}"
        with pytest.raises(grpc.aio.AioRpcError) as err:
            if method == "Generate":
                async for _ in self.channel.unary_stream(path, request_serializer=bytes)(data, timeout=10):
                    pass
            else:
                await self.channel.unary_unary(path, request_serializer=bytes)(data, timeout=10)
        return err.value
