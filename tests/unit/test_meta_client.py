"""The gateway's MetaClient.route (in-process meta-servers on port 0, real gRPC): the
meta-server's decisions and status codes, per call on one channel (concurrent calls,
an error does not touch the others); following the leader (a standby answers
FAILED_PRECONDITION, a dead leader's calls fail over to the next meta-server), and
reconnecting to a restarted meta-server."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from common.config import MetaConfig
from protos.pdmesh.v1 import common_pb2, meta_pb2, meta_pb2_grpc
from services.gateway.meta_client import MetaClient
from services.meta_server.server import create_server


class FakeElection:
    def __init__(self, leading: bool):
        self.is_leader = self.was_leader = leading

    async def resign(self) -> None:
        pass


def node(node_id: str, role: str) -> common_pb2.NodeInfo:
    return common_pb2.NodeInfo(node_id=node_id, role=role, address=f"{node_id}.local:1", model_id="m",
                               kv_layout=common_pb2.KVLayout(block_size=16, num_blocks=64))


async def start_meta(port: int = 0, leading: bool | None = None,
                     nodes=(("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"), ("d1", "decode"))):
    """A meta-server with these nodes registered; leading None: no election."""
    server, port = await create_server(MetaConfig(port=0, ttl_seconds=60.0), port=port)
    if leading is not None:
        server.control.election = FakeElection(leading)
    for node_id, role in nodes:
        server.control.register(node(node_id, role))
    return server, f"127.0.0.1:{port}"


def route_request(rid: str = "r", model: str = "m") -> meta_pb2.RouteRequest:
    return meta_pb2.RouteRequest(request_id=rid, model_id=model, num_prompt_tokens=100)


async def stop(server) -> None:
    await server.stop(0)
    await server.close_extras()


def test_route_answers_with_the_routers_decisions_and_fallbacks():
    async def main():
        server, address = await start_meta()
        client = MetaClient([address])
        try:
            unary = meta_pb2_grpc.MetaServerStub(client._channels[0])
            got = []
            for i in range(3):
                r = await client.route(route_request(f"r{i}"))
                got.append((r.decode.node_id, r.prefill.node_id, r.local_prefill,
                            [f.node_id for f in r.prefill_fallbacks]))
            assert got == [("d0", "p0", False, ["p1"]), ("d1", "p1", False, ["p0"]), ("d0", "p0", False, ["p1"])]
            together = await asyncio.gather(*(client.route(route_request(f"c{i}")) for i in range(4)))
            assert sorted(r.decode.node_id for r in together) == ["d0", "d0", "d1", "d1"]
            reply = await unary.Route(route_request())
            assert (reply.decode.node_id, reply.decode.address) == ("d1", "d1.local:1")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.route(route_request(model="other"))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert err.value.details() == "no live, undrained decode node for model 'other'"
            assert (await client.route(route_request())).decode.node_id == "d0"  # same channel, still up
            assert server.control.stats().num_routed == 9
        finally:
            await client.close()
            await stop(server)
    asyncio.run(main())


def test_standby_answers_failed_precondition_per_call_and_the_client_follows():
    async def main():
        standby, standby_address = await start_meta(leading=False)
        leader, leader_address = await start_meta(leading=True)
        client = MetaClient([standby_address, leader_address], follow_timeout_s=3.0)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await meta_pb2_grpc.MetaServerStub(client._channels[0]).Route(route_request())
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "is a standby; another meta-server leads" in err.value.details()

            assert (await client.route(route_request())).decode.node_id == "d0"
            assert client.current_address == leader_address
            assert leader.control.stats().num_routed == 1 and standby.control.stats().num_routed == 0

            # the leader dies; the standby takes over: the client follows
            standby.control.election.is_leader = True
            await stop(leader)
            assert (await client.route(route_request())).decode.node_id == "d0"
            assert client.current_address == standby_address
            assert standby.control.stats().num_routed == 1
        finally:
            await client.close()
            await stop(standby)
    asyncio.run(main())


def test_client_reconnects_to_a_restarted_meta_server():
    async def main():
        server, address = await start_meta()
        client = MetaClient([address], follow_timeout_s=5.0)
        try:
            assert (await client.route(route_request())).decode.node_id == "d0"
            await stop(server)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await MetaClient([address], follow_timeout_s=0.5).route(route_request(), timeout=0.5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE

            async def restart():
                await asyncio.sleep(0.5)
                return await start_meta(port=int(address.rsplit(":", 1)[1]))

            restarting = asyncio.ensure_future(restart())
            reply = await client.route(route_request())  # follows (retries) until it is back
            server, _ = await restarting
            assert reply.decode.node_id == "d0" and server.control.stats().num_routed == 1
        finally:
            await client.close()
            await stop(server)
    asyncio.run(main())
