"""The gateway's side of migration, exactly: a real gateway servicer and meta-server in one
process, decode nodes that break every stream after a token (real gRPC servers that
stream one token, then end the call UNAVAILABLE, as a dying node does). Each attempt
gets the original prompt plus the tokens so far, resume_position = their count and the
remaining max_tokens; the client's stream carries every token once; past
gateway.max_migrations the client gets UNAVAILABLE. (That real decode nodes resume
with the right tokens is the fault matrix's job: tests/faults/.)"""
from __future__ import annotations

import asyncio

import grpc
import pytest

from common.config import MetaConfig
from common.model.tokenizer import Tokenizer
from protos.pdmesh.v1 import (common_pb2, engine_pb2, engine_pb2_grpc, gateway_pb2, gateway_pb2_grpc, meta_pb2,
                              meta_pb2_grpc)
from services.gateway.servicer import GatewayServicer
from services.meta_server.server import create_server
from tests.channels import operator_channel

PROMPT = [5, 6, 7, 8]
pytestmark = pytest.mark.timeout(60)


SCRIPT = [100, 101, 102, 103]   # the request's output, whichever node produces each token


class BreakingDecode(engine_pb2_grpc.DecodeServicer):
    """Streams one token per call, script[resume_position] (what the request's output is
    there), then fails UNAVAILABLE as a dying node does; records the requests."""

    def __init__(self, script: list[int]):
        self.script = script
        self.requests: list[engine_pb2.DecodeRequest] = []

    async def Generate(self, request, context):
        self.requests.append(request)
        yield engine_pb2.DecodeResponse(token_ids=[self.script[request.resume_position]])
        await context.abort(grpc.StatusCode.UNAVAILABLE, "the node died")


async def start_mesh(model_dir, num_nodes: int, max_migrations: int, script: list[int] = SCRIPT):
    meta, meta_port = await create_server(MetaConfig(port=0, ttl_seconds=30.0))
    nodes, servers = [], []
    channel = operator_channel(f"127.0.0.1:{meta_port}")
    for i in range(num_nodes):
        servicer, server = BreakingDecode(script), grpc.aio.server()
        engine_pb2_grpc.add_DecodeServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        await meta_pb2_grpc.MetaServerStub(channel).Register(meta_pb2.RegisterRequest(
            node=common_pb2.NodeInfo(node_id=f"decode-{i}", role="decode", address=f"127.0.0.1:{port}",
                                     model_id="tiny"), ttl_seconds=30.0))
        nodes.append(servicer)
        servers.append(server)
    await channel.close()
    gateway = GatewayServicer(Tokenizer.from_dir(model_dir), "tiny", 1024, 512, f"127.0.0.1:{meta_port}",
                              max_migrations=max_migrations)
    gw_server = grpc.aio.server()
    gateway_pb2_grpc.add_GatewayServicer_to_server(gateway, gw_server)
    gw_port = gw_server.add_insecure_port("127.0.0.1:0")
    await gw_server.start()

    async def close():
        await gw_server.stop(None)
        await gateway.close()
        for s in servers:
            await s.stop(None)
        await meta.stop(None)
        await meta.close_extras()
    return f"127.0.0.1:{gw_port}", nodes, close


async def generate(address: str, max_tokens: int, stop: list[str] = ()):
    req = gateway_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(max_tokens=max_tokens, seed=9,
                                                                         temperature=0.8, stop=stop))
    req.prompt_token_ids.ids.extend(PROMPT)
    msgs, error = [], None
    async with operator_channel(address) as ch:
        try:
            async for m in gateway_pb2_grpc.GatewayStub(ch).Generate(req, timeout=20):
                msgs.append(m)
        except grpc.aio.AioRpcError as e:
            error = e
    return msgs, error


def test_each_attempt_resumes_where_the_last_one_broke_until_max_migrations(tiny_model):
    async def scenario():
        address, nodes, close = await start_mesh(tiny_model("llama"), num_nodes=3, max_migrations=2)
        try:
            return await generate(address, max_tokens=10), nodes
        finally:
            await close()

    (msgs, error), nodes = asyncio.run(scenario())
    requests = sorted((r for n in nodes for r in n.requests), key=lambda r: r.resume_position)
    assert [r.resume_position for r in requests] == [0, 1, 2]          # 1 attempt + 2 migrations
    tokens = [t for m in msgs for t in m.token_ids]
    assert tokens == SCRIPT[:3]                                         # each once, in order
    assert all(len(n.requests) == 1 for n in nodes)                     # a failed node is not asked again
    for k, r in enumerate(requests):
        assert list(r.prompt_token_ids) == PROMPT + tokens[:k]          # prompt + what the client has
        assert r.sampling.max_tokens == 10 - k and r.sampling.seed == 9
    assert len({r.request_id for r in requests}) == 3                   # a new mesh id per attempt
    assert error is not None and error.code() == grpc.StatusCode.UNAVAILABLE


def test_max_migrations_zero_fails_the_broken_stream(tiny_model):
    async def scenario():
        address, nodes, close = await start_mesh(tiny_model("llama"), num_nodes=2, max_migrations=0)
        try:
            return await generate(address, max_tokens=10), nodes
        finally:
            await close()

    (msgs, error), nodes = asyncio.run(scenario())
    assert sum(len(n.requests) for n in nodes) == 1
    assert len([t for m in msgs for t in m.token_ids]) == 1
    assert error.code() == grpc.StatusCode.UNAVAILABLE


def test_a_stop_string_across_the_seam_stops_the_stream(tiny_model):
    """The stop string starts in the token the first node sent and ends in the one its
    successor sent: the gateway's matcher carries across the migration."""
    model = tiny_model("llama")
    tok = Tokenizer.from_dir(model)
    words = [i for i in range(256, 1024) if tok.decode([i]).isalpha() and len(tok.decode([i])) >= 3][:3]
    first, second = tok.decode([words[0]]), tok.decode([words[1]])
    stop = first[-2:] + second[:1]
    assert (first + second + tok.decode([words[2]])).find(stop) == len(first) - 2   # only across the seam
    assert tok.decode(words[:2]) == first + second

    async def scenario():
        address, nodes, close = await start_mesh(model, num_nodes=3, max_migrations=2, script=words)
        try:
            return await generate(address, max_tokens=10, stop=[stop])
        finally:
            await close()

    msgs, error = asyncio.run(scenario())
    assert error is None
    assert [t for m in msgs for t in m.token_ids] == words[:2]
    assert "".join(m.text for m in msgs) == first[:-2]
    assert msgs[-1].finish_reason == "stop" and msgs[-1].migrations == 1
    assert (msgs[-1].usage.prompt_tokens, msgs[-1].usage.completion_tokens) == (len(PROMPT), 2)
