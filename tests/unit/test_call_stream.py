"""services/call_stream over a real gRPC stream (in-process server on port 0): unary and
streaming calls matched by call_id, status codes per call, deadlines on both sides,
cancel (on_cancel before the task unwinds), a broken stream failing its open calls and
the next call opening a new one, and the server stopping every call when the client goes."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from protos.pdmesh.v1 import common_pb2, engine_pb2, meta_pb2
from services.call_stream import CallError, CallStreamClient, CallStreamServer

SERVICE = "pdmesh.test.Calls"
UNARY = (meta_pb2.RouteStreamRequest, meta_pb2.RouteStreamResponse)
STREAMING = (engine_pb2.GenerateStreamRequest, engine_pb2.GenerateStreamResponse)


class Harness:
    """A server with one unary ("Unary") and one streaming ("Streaming") call-stream RPC,
    and a record of what its handlers saw."""

    def __init__(self, unary=None, streaming=None):
        self.events: list[tuple] = []
        self.num_streams = 0
        self.unary, self.streaming = unary, streaming

    async def start(self, port: int = 0) -> int:
        async def on_cancel(request):
            self.events.append(("on_cancel", request.call_id))

        def method(kind, handle):
            request_type, response_type = kind

            async def serve(request_iterator, context):
                self.num_streams += 1
                await CallStreamServer(handle, response_type, on_cancel).serve(request_iterator, context)
            return grpc.stream_stream_rpc_method_handler(
                serve, request_deserializer=request_type.FromString,
                response_serializer=response_type.SerializeToString)

        self.server = grpc.aio.server()
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
            "Unary": method(UNARY, self.unary), "Streaming": method(STREAMING, self.streaming)}),))
        self.port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        await self.server.start()
        return self.port

    def client(self, kind: str) -> tuple[grpc.aio.Channel, CallStreamClient]:
        request_type, response_type = UNARY if kind == "Unary" else STREAMING
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.port}")
        open_stream = channel.stream_stream(f"/{SERVICE}/{kind}",
                                            request_serializer=request_type.SerializeToString,
                                            response_deserializer=response_type.FromString)
        return channel, CallStreamClient(open_stream)


def route(name: str, delay_ms: int = 0) -> meta_pb2.RouteStreamRequest:
    return meta_pb2.RouteStreamRequest(route=meta_pb2.RouteRequest(request_id=name,
                                                                   num_prompt_tokens=delay_ms))


def run(test, unary=None, streaming=None):
    async def main():
        h = Harness(unary, streaming)
        await h.start()
        try:
            await test(h)
        finally:
            await h.server.stop(0)
    asyncio.run(main())


async def echo_after_delay(request):
    """Answers RouteResponse(decode.node_id=request_id) after num_prompt_tokens ms;
    request_id 'unavailable' / 'bug' fail."""
    r = request.route
    await asyncio.sleep(r.num_prompt_tokens / 1000)
    if r.request_id == "unavailable":
        raise CallError(grpc.StatusCode.UNAVAILABLE, "no live decode node for model 'm'")
    if r.request_id == "bug":
        raise RuntimeError("boom")
    decode = common_pb2.NodeInfo(node_id=r.request_id)
    return meta_pb2.RouteStreamResponse(route=meta_pb2.RouteResponse(decode=decode))


def test_unary_calls_are_matched_by_call_id_whatever_the_order():
    async def test(h):
        channel, client = h.client("Unary")
        done: list[str] = []

        async def one(name, delay):
            reply = await client.call(route(name, delay), timeout=5)
            done.append(name)
            return reply.route.decode.node_id

        got = await asyncio.gather(one("slow", 60), one("fast", 0), one("mid", 20))
        assert got == ["slow", "fast", "mid"]
        assert done == ["fast", "mid", "slow"]
        assert h.num_streams == 1
        await client.close()
        await channel.close()
    run(test, unary=echo_after_delay)


def test_each_call_carries_its_own_status_and_the_stream_stays_usable():
    async def test(h):
        channel, client = h.client("Unary")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.call(route("unavailable"), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert err.value.details() == "no live decode node for model 'm'"
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.call(route("bug"), timeout=5)
        assert err.value.code() == grpc.StatusCode.INTERNAL and "boom" in err.value.details()
        assert (await client.call(route("ok"), timeout=5)).route.decode.node_id == "ok"
        assert h.num_streams == 1
        await client.close()
        await channel.close()
    run(test, unary=echo_after_delay)


def test_deadline_fails_the_call_and_stops_it_on_the_server():
    stopped = []

    async def slow(request):
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            stopped.append(request.call_id)
            raise

    async def test(h):
        channel, client = h.client("Unary")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.call(route("x"), timeout=0.2)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        for _ in range(100):
            if stopped:
                break
            await asyncio.sleep(0.01)
        assert stopped == [1] and h.events == [("on_cancel", 1)]  # timeout_s went with the call
        await client.close()
        await channel.close()
    run(test, unary=slow)


def test_broken_stream_fails_open_calls_then_the_next_call_opens_a_new_one():
    async def test(h):
        channel, client = h.client("Unary")
        assert (await client.call(route("a"), timeout=5)).route.decode.node_id == "a"
        pending = asyncio.ensure_future(client.call(route("b", 5000), timeout=10))
        await asyncio.sleep(0.1)
        await h.server.stop(0)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pending
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert h.events == [("on_cancel", 2)]  # the server stopped the call it was running
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.call(route("c"), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        await h.start(h.port)  # back on the same port
        for _ in range(50):
            try:
                reply = await client.call(route("d"), timeout=5)
                break
            except grpc.aio.AioRpcError as e:
                assert e.code() == grpc.StatusCode.UNAVAILABLE
                await asyncio.sleep(0.1)
        assert reply.route.decode.node_id == "d"
        assert h.num_streams == 2
        await client.close()
        await channel.close()
    run(test, unary=echo_after_delay)


def test_client_leaving_stops_every_running_call():
    async def slow(request):
        await asyncio.sleep(10)

    async def test(h):
        channel, client = h.client("Unary")
        calls = [asyncio.ensure_future(client.call(route(n), timeout=10)) for n in ("a", "b")]
        await asyncio.sleep(0.2)
        await client.close()
        for call in calls:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call
            assert err.value.code() == grpc.StatusCode.CANCELLED
        for _ in range(100):
            if len(h.events) == 2:
                break
            await asyncio.sleep(0.01)
        assert sorted(h.events) == [("on_cancel", 1), ("on_cancel", 2)]
        await channel.close()
    run(test, unary=slow)


# ---- streaming calls ------------------------------------------------------------------
def generate(n: int, fail_after: int = -1, mark_last: bool = True) -> engine_pb2.GenerateStreamRequest:
    return engine_pb2.GenerateStreamRequest(generate=engine_pb2.DecodeRequest(
        request_id=f"{n}:{fail_after}:{int(mark_last)}", prompt_token_ids=[n]))


async def count_up(request):
    """Yields tokens 0..n-1, the last with finish_reason (and end) when mark_last; fails
    with UNAVAILABLE after fail_after tokens; a 0-token call sleeps until cancelled."""
    n, fail_after, mark_last = (int(x) for x in request.generate.request_id.split(":"))
    if n == 0:
        await asyncio.sleep(10)
    for i in range(n):
        if i == fail_after:
            raise CallError(grpc.StatusCode.UNAVAILABLE, "decode node went away")
        last = mark_last and i == n - 1
        reply = engine_pb2.DecodeResponse(token_ids=[i], finish_reason="length" if last else "")
        yield engine_pb2.GenerateStreamResponse(response=reply, end=last)
        await asyncio.sleep(0)


def test_streaming_calls_interleave_and_end_on_their_last_message():
    async def test(h):
        channel, client = h.client("Streaming")

        async def collect(req):
            return [(list(m.response.token_ids), m.response.finish_reason, m.end)
                    async for m in client.open(req, 5)]

        a, b, bare = await asyncio.gather(collect(generate(3)), collect(generate(2)),
                                          collect(generate(2, mark_last=False)))
        assert a == [([0], "", False), ([1], "", False), ([2], "length", True)]
        assert b == [([0], "", False), ([1], "length", True)]
        assert bare == [([0], "", False), ([1], "", False)]  # the bare end is not yielded
        assert h.num_streams == 1
        await client.close()
        await channel.close()
    run(test, streaming=count_up)


def test_streaming_error_after_partial_output():
    async def test(h):
        channel, client = h.client("Streaming")
        got = []
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for m in client.open(generate(5, fail_after=2), 5):
                got.append(m.response.token_ids[0])
        assert got == [0, 1]
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert err.value.details() == "decode node went away"
        await client.close()
        await channel.close()
    run(test, streaming=count_up)


def test_leaving_a_streaming_call_stops_it_on_the_server_without_an_answer():
    async def test(h):
        channel, client = h.client("Streaming")
        call = client.open(generate(0), 5)
        waiting = asyncio.ensure_future(call.__anext__())
        await asyncio.sleep(0.2)
        call.cancel()
        for _ in range(100):
            if h.events:
                break
            await asyncio.sleep(0.01)
        assert h.events == [("on_cancel", 1)]
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call.__anext__()
        got = [m.response.token_ids[0] async for m in client.open(generate(2), 5)]
        assert got == [0, 1] and h.num_streams == 1
        await client.close()
        await channel.close()
    run(test, streaming=count_up)


def test_streaming_deadline():
    async def test(h):
        channel, client = h.client("Streaming")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in client.open(generate(0), 0.2):
                pass
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        for _ in range(100):
            if h.events:
                break
            await asyncio.sleep(0.01)
        assert h.events == [("on_cancel", 1)]
        await client.close()
        await channel.close()
    run(test, streaming=count_up)
