"""The decode node's RemotePrefillCall against a prefill node's PrefillStream (real gRPC,
in process; the prefill node's Prefill and stop_writes are fakes that record what
happens): the first token, status codes, the cancel guarantee (the prefill node has
stopped its writes before cancel() returns), a prefill stopped when the decode node goes
away or its deadline passes, and the unary fallback for a node without PrefillStream."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from protos.pdmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from services.decode.remote_prefill import PrefillStreams, RemotePrefillCall
from services.prefill.stream import serve_prefill_stream


class FakePrefill(engine_pb2_grpc.PrefillServicer):
    """Prefill takes prompt_token_ids[0] ms and answers first_token_id = prompt length;
    request_id 'bad' is INVALID_ARGUMENT. stop_writes takes 50 ms (writes in flight)."""

    def __init__(self):
        self.events: list[tuple[str, str]] = []
        self.running: set[str] = set()

    async def Prefill(self, request, context):
        rid = request.request_id
        if rid == "bad":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "destination.block_ids has 0 ids")
        self.events.append(("start", rid))
        self.running.add(rid)
        try:
            await asyncio.sleep(request.prompt_token_ids[0] / 1000)
        except asyncio.CancelledError:
            self.events.append(("cancelled", rid))
            raise
        finally:
            self.running.discard(rid)
        return engine_pb2.PrefillResponse(first_token_id=len(request.prompt_token_ids),
                                          timing=common_pb2.PrefillTiming(remote=True, compute_ms=1.0))

    async def CancelPrefill(self, request, context):
        self.events.append(("unary cancel", request.request_id))
        return engine_pb2.CancelPrefillResponse(was_running=request.request_id in self.running)

    async def stop_writes(self, request_id: str) -> bool:
        self.events.append(("stop_writes", request_id))
        await asyncio.sleep(0.05)
        self.events.append(("writes_stopped", request_id))
        return True

    async def PrefillStream(self, request_iterator, context):
        await serve_prefill_stream(self, request_iterator, context)


class UnaryOnlyPrefill(FakePrefill):
    PrefillStream = engine_pb2_grpc.PrefillServicer.PrefillStream  # UNIMPLEMENTED


class FakeDecodeNode:
    """What RemotePrefillCall uses of an EngineNode."""

    def __init__(self):
        self.node = SimpleNamespace(node_id="decode-0")
        self.transfer = SimpleNamespace(endpoint="127.0.0.1:1")
        self.layout = SimpleNamespace(to_proto=lambda: common_pb2.KVLayout(block_size=16))
        self.channels: dict[str, grpc.aio.Channel] = {}

    def channel(self, address: str) -> grpc.aio.Channel:
        if address not in self.channels:
            self.channels[address] = grpc.aio.insecure_channel(address)
        return self.channels[address]


def run(test, servicer_type=FakePrefill):
    async def main():
        servicer = servicer_type()
        server = grpc.aio.server()
        engine_pb2_grpc.add_PrefillServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        node = FakeDecodeNode()
        streams = PrefillStreams(node)
        prefill = common_pb2.NodeInfo(node_id="prefill-0", address=f"127.0.0.1:{port}")

        def call(rid: str, ms: int, timeout_s: float = 10.0) -> RemotePrefillCall:
            return RemotePrefillCall(node, rid, [ms, 5, 6], common_pb2.SamplingParams(), prefill, timeout_s,
                                     streams)

        try:
            await test(call, servicer, streams)
        finally:
            await streams.close()
            for ch in node.channels.values():
                await ch.close()
            await server.stop(0)
    asyncio.run(main())


async def until(predicate, timeout_s: float = 2.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


def test_prefills_share_one_stream_and_return_their_first_token():
    async def test(call, servicer, streams):
        a, b = call("a", 30), call("b", 0)
        assert await asyncio.gather(a.run([1], 0), b.run([2], 0)) == [3, 3]
        assert a.reply.timing.remote and a.reply.timing.compute_ms == 1.0
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call("bad", 0).run([3], 0)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == "destination.block_ids has 0 ids"
        assert servicer.events == [("start", "a"), ("start", "b")]
        assert list(streams._streams) == [call("x", 0).prefill.address]
    run(test)


def test_cancel_returns_once_the_prefill_node_stopped_writing():
    async def test(call, servicer, streams):
        c = call("r", 5000)
        task = asyncio.ensure_future(c.run([1], 0))
        await until(lambda: servicer.events == [("start", "r")])
        await c.cancel()
        assert servicer.events == [("start", "r"), ("stop_writes", "r"), ("writes_stopped", "r"),
                                   ("cancelled", "r")]
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await call("next", 0).run([2], 0) == 3  # the stream is still up
    run(test)


def test_cancel_before_run_sends_nothing():
    async def test(call, servicer, streams):
        c = call("r", 0)
        await c.cancel()
        with pytest.raises(asyncio.CancelledError):
            await c.run([1], 0)
        assert servicer.events == []
    run(test)


def test_decode_node_going_away_stops_its_prefills():
    async def test(call, servicer, streams):
        tasks = [asyncio.ensure_future(call(rid, 5000).run([1], 0)) for rid in ("a", "b")]
        await until(lambda: len(servicer.events) == 2)
        await streams.close()  # as when the decode process dies: its stream ends
        for task in tasks:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await task
            assert err.value.code() == grpc.StatusCode.CANCELLED
        await until(lambda: len(servicer.events) == 8)
        for rid in ("a", "b"):
            mine = [e for e, r in servicer.events if r == rid]
            assert mine == ["start", "stop_writes", "writes_stopped", "cancelled"]
    run(test)


def test_deadline_stops_the_prefill_on_its_node():
    async def test(call, servicer, streams):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call("r", 5000, timeout_s=0.3).run([1], 0)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await until(lambda: len(servicer.events) == 4)
        assert servicer.events == [("start", "r"), ("stop_writes", "r"), ("writes_stopped", "r"),
                                   ("cancelled", "r")]
    run(test)


def test_node_without_prefill_stream_gets_unary_calls():
    async def test(call, servicer, streams):
        assert await call("a", 0).run([1], 0) == 3
        address = call("x", 0).prefill.address
        assert streams.unary_only == {address}
        c = call("b", 5000)
        task = asyncio.ensure_future(c.run([1], 0))
        await until(lambda: ("start", "b") in servicer.events)
        await c.cancel()
        assert ("unary cancel", "b") in servicer.events
        with pytest.raises(asyncio.CancelledError):
            await task
    run(test, UnaryOnlyPrefill)
