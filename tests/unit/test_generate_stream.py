"""The gateway's DecodeClient against a decode node's GenerateStream (real gRPC, in
process; the node's Generate is a fake): each call's messages in order up to the one with
finish_reason, concurrent calls on one stream, Generate's status codes, leaving a call
aborts it on the node, and the unary-stream fallback for a node without GenerateStream."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from protos.pdmesh.v1 import engine_pb2, engine_pb2_grpc
from services.decode.generate_stream import serve_generate_stream
from services.gateway.decode_client import DecodeClient


class FakeDecode(engine_pb2_grpc.DecodeServicer):
    """Generate yields prompt_token_ids[0] tokens 100, 101, ... (finish_reason "length" on
    the last), one every prompt_token_ids[1] ms; request_id 'bad' is INVALID_ARGUMENT."""

    def __init__(self):
        self.events: list[tuple[str, str]] = []

    async def Generate(self, request, context):
        rid = request.request_id
        if rid == "bad":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "max_tokens must be an integer >= 1")
        n, every_ms = request.prompt_token_ids[0], request.prompt_token_ids[1]
        try:
            for i in range(n):
                await asyncio.sleep(every_ms / 1000)
                last = i == n - 1
                yield engine_pb2.DecodeResponse(token_ids=[100 + i], finish_reason="length" if last else "")
        except asyncio.CancelledError:
            self.events.append(("aborted", rid))
            raise

    async def GenerateStream(self, request_iterator, context):
        await serve_generate_stream(self, request_iterator, context)


class UnaryOnlyDecode(FakeDecode):
    GenerateStream = engine_pb2_grpc.DecodeServicer.GenerateStream  # UNIMPLEMENTED


def run(test, servicer_type=FakeDecode):
    async def main():
        servicer = servicer_type()
        server = grpc.aio.server()
        engine_pb2_grpc.add_DecodeServicer_to_server(servicer, server)
        address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        client = DecodeClient()
        try:
            await test(client, address, servicer)
        finally:
            await client.close()
            await server.stop(0)
    asyncio.run(main())


def decode_request(rid: str, n: int, every_ms: int = 0) -> engine_pb2.DecodeRequest:
    return engine_pb2.DecodeRequest(request_id=rid, prompt_token_ids=[n, every_ms])


async def collect(client, address, request) -> list[tuple[list[int], str]]:
    return [(list(m.token_ids), m.finish_reason) async for m in client.generate(address, request, 10.0)]


def test_calls_share_one_stream_and_end_with_finish_reason():
    async def test(client, address, servicer):
        a, b = await asyncio.gather(collect(client, address, decode_request("a", 3, 5)),
                                    collect(client, address, decode_request("b", 2, 1)))
        assert a == [([100], ""), ([101], ""), ([102], "length")]
        assert b == [([100], ""), ([101], "length")]
        assert list(client._streams) == [address] and not client.unary_only
    run(test)


def test_generate_status_codes_pass_through():
    async def test(client, address, servicer):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(client, address, decode_request("bad", 1))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == "max_tokens must be an integer >= 1"
        assert await collect(client, address, decode_request("ok", 1)) == [([100], "length")]
    run(test)


def test_leaving_a_call_aborts_it_on_the_decode_node():
    async def test(client, address, servicer):
        call = client.generate(address, decode_request("long", 1000, 10), 10.0)
        got = []
        async for m in call:
            got.append(m.token_ids[0])
            if len(got) == 2:
                break
        call.cancel()
        for _ in range(200):
            if servicer.events:
                break
            await asyncio.sleep(0.01)
        assert got == [100, 101] and servicer.events == [("aborted", "long")]
    run(test)


def test_node_without_generate_stream_gets_unary_stream_calls():
    async def test(client, address, servicer):
        assert await collect(client, address, decode_request("a", 2)) == [([100], ""), ([101], "length")]
        assert client.unary_only == {address}
        assert await collect(client, address, decode_request("b", 1)) == [([100], "length")]
    run(test, UnaryOnlyDecode)
