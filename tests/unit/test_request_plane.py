"""The request plane's own guarantees: plain gRPC calls on one shared channel with a
bounded number in flight per peer (RESOURCE_EXHAUSTED at once beyond it, the others
untouched), each call's own deadline and cancellation; and the timeouts' order checked
when a config is loaded."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from common.config import TimeoutConfig, mesh_config_from_dict
from protos.pdmesh.v1 import engine_pb2, engine_pb2_grpc
from services.gateway.decode_client import DecodeClient
from services.node.grpc_util import PeerLimits


class SlowDecode(engine_pb2_grpc.DecodeServicer):
    """Generate streams one token per 50 ms until max_tokens; records the calls that
    started and those stopped before their last token (whether the server stopped the
    handler while it slept, CancelledError, or while it waited at a yield, GeneratorExit)."""

    def __init__(self):
        self.started: list[str] = []
        self.cancelled: list[str] = []

    async def Generate(self, request, context):
        self.started.append(request.request_id)
        finished = False
        try:
            for i in range(request.sampling.max_tokens):
                await asyncio.sleep(0.05)
                yield engine_pb2.DecodeResponse(token_ids=[i])
            finished = True
        finally:
            if not finished:
                self.cancelled.append(request.request_id)


def request(rid: str, n: int) -> engine_pb2.DecodeRequest:
    req = engine_pb2.DecodeRequest(request_id=rid)
    req.sampling.max_tokens = n
    return req


def test_calls_beyond_the_per_peer_bound_are_refused_at_once_and_the_rest_go_on():
    async def main():
        servicer = SlowDecode()
        server = grpc.aio.server()
        engine_pb2_grpc.add_DecodeServicer_to_server(servicer, server)
        address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        client = DecodeClient(max_calls_per_peer=2)
        try:
            async def tokens(call):
                return [t async for m in call for t in m.token_ids]

            a = client.generate(address, request("a", 6), timeout_s=10)
            b = client.generate(address, request("b", 6), timeout_s=10)
            running = [asyncio.ensure_future(tokens(a)), asyncio.ensure_future(tokens(b))]
            await asyncio.sleep(0.1)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await tokens(client.generate(address, request("c", 1), timeout_s=10))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            b.cancel()                                   # leaving one call frees its place ...
            with pytest.raises(asyncio.CancelledError):
                await running[1]
            assert await tokens(client.generate(address, request("d", 2), timeout_s=10)) == [0, 1]
            assert await running[0] == [0, 1, 2, 3, 4, 5]   # ... and never touched the others
            with pytest.raises(grpc.aio.AioRpcError) as late:
                await tokens(client.generate(address, request("e", 100), timeout_s=0.2))
            assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED   # its own deadline
            # the server learns of a client's cancel or deadline asynchronously: poll (on a
            # loaded machine the suite saw this take over a second); "e" may also have run
            # out of time before its handler started (then there is nothing to stop)
            def stopped() -> bool:
                return "b" in servicer.cancelled and ("e" not in servicer.started or "e" in servicer.cancelled)
            for _ in range(1500):
                if stopped():
                    break
                await asyncio.sleep(0.02)
            assert stopped(), (servicer.started, servicer.cancelled)   # the server stopped both
            assert client.limits.in_flight == {}
        finally:
            await client.close()
            await server.stop(None)
    asyncio.run(main())


def test_peer_limits_count_per_peer():
    limits = PeerLimits(1)
    first = limits.acquire("x:1")
    with limits.acquire("y:1"):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            limits.acquire("x:1")
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    first.release()
    first.release()   # idempotent
    assert limits.in_flight == {}


@pytest.mark.parametrize("fields,named", [
    ({"transfer_s": 8.0}, ["2 x timeouts.transfer_s (16.0) must be < timeouts.cancel_ack_s (15.0)"]),
    ({"cancel_ack_s": 40.0}, ["timeouts.cancel_ack_s (40.0)", "timeouts.prefill_s (30.0)"]),
    ({"prefill_s": 900.0}, ["timeouts.prefill_s (900.0)", "timeouts.request_s (600.0)"]),
    ({"kv_store_pin_lease_s": 5.0}, ["timeouts.kv_store_pin_lease_s (5.0) must be > 2 x timeouts.transfer_s (10.0)"]),
    ({"kv_store_reserve_lease_s": 10.0}, ["timeouts.kv_store_reserve_lease_s (10.0)"]),
    ({"route_s": 0}, ["timeouts.route_s must be > 0"]),
])
def test_timeouts_out_of_order_are_refused_naming_the_fields(fields, named):
    with pytest.raises(ValueError) as err:
        TimeoutConfig(**fields)
    for text in named:
        assert text in str(err.value)
    with pytest.raises(ValueError, match="timeouts"):
        mesh_config_from_dict({"model": "m", "timeouts": fields})


def test_unknown_timeout_is_refused_with_the_allowed_names():
    with pytest.raises(ValueError, match=r"timeouts: unknown field\(s\) \['prefill_timeout_s'\]; allowed: .*transfer_s"):
        mesh_config_from_dict({"model": "m", "timeouts": {"prefill_timeout_s": 3}})
