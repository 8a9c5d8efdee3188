"""A decode node tells the truth about itself (services/node/node_health.py), in one
process with a real meta-server and a real node server (fake transfer, local prefill):
a step that hangs past timeouts.stall_s, or a command left waiting that long, makes it
NOT_SERVING and stalled in its load (routed to no more) until it makes progress; an engine whose step loop raised makes it
NOT_SERVING and gone from the mesh by its own Deregister (POLL_S + one RPC), fails its streams UNAVAILABLE (so
the gateway migrates them) and sets `failed` (the process then exits 1)."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.config import MeshConfig, MetaConfig, NodeConfig, TimeoutConfig, TransferConfig
from protos.pdmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc, meta_pb2, meta_pb2_grpc
from services.meta_server.server import create_server
from services.node.fault_injection import _fail_next_step
from services.node.node_server import create_node_server, stop_node_server
from tests.channels import operator_channel

TTL = 1.0
STALL_S = 0.5
HANG_GUARD_S = 30.0     # a wait's bound: only catches a hang, never a slow host
LONG_TTL = 4 * HANG_GUARD_S   # no lease lapses within a wait: a node leaves only by its own Deregister
pytestmark = pytest.mark.timeout(120)


class Mesh:
    """A meta-server and one decode node, in this process."""

    async def start(self, model, ttl: float = TTL) -> "Mesh":
        self.meta, meta_port = await create_server(MetaConfig(port=0, ttl_seconds=ttl))
        mesh = MeshConfig(model=str(model), engine={"num_blocks": 64, "max_model_len": 512},
                          meta=MetaConfig(port=meta_port, ttl_seconds=ttl),
                          transfer=TransferConfig(backend="fake"),
                          timeouts=TimeoutConfig(stall_s=STALL_S))
        self.node_server, port = await create_node_server(mesh, NodeConfig("decode", "decode-0"), 0)
        self.node = self.node_server.node
        self.channel = operator_channel(f"127.0.0.1:{port}")
        self.meta_channel = operator_channel(f"127.0.0.1:{meta_port}")
        await self.wait(lambda: self.members(), "registration")
        return self

    async def health(self) -> int:
        reply = await health_pb2_grpc.HealthStub(self.channel).Check(health_pb2.HealthCheckRequest(service=""))
        return reply.status

    async def members(self) -> list[common_pb2.NodeInfo]:
        reply = await meta_pb2_grpc.MetaServerStub(self.meta_channel).ListMembers(meta_pb2.ListMembersRequest())
        return list(reply.nodes)

    async def route(self) -> grpc.StatusCode:
        try:
            await meta_pb2_grpc.MetaServerStub(self.meta_channel).Route(
                meta_pb2.RouteRequest(request_id="r", num_prompt_tokens=8), timeout=5)
        except grpc.aio.AioRpcError as e:
            return e.code()
        return grpc.StatusCode.OK

    def generate(self, rid: str, max_tokens: int):
        req = engine_pb2.DecodeRequest(request_id=rid, prompt_token_ids=list(range(5, 40)))
        req.sampling.max_tokens, req.sampling.temperature, req.sampling.ignore_eos = max_tokens, 0.0, True
        return engine_pb2_grpc.DecodeStub(self.channel).Generate(req, timeout=60)

    @staticmethod
    async def wait(predicate, what: str, timeout_s: float = HANG_GUARD_S) -> float:
        start = time.monotonic()
        while not await predicate():
            assert time.monotonic() - start < timeout_s, f"timed out waiting for {what}"
            await asyncio.sleep(0.02)
        return time.monotonic() - start

    async def close(self) -> None:
        await self.channel.close()
        await self.meta_channel.close()
        await stop_node_server(self.node_server, 0.5)
        await self.meta.stop(None)
        await self.meta.close_extras()


def test_a_hung_step_is_not_serving_and_unrouted_until_it_ends(tiny_model):
    async def scenario():
        mesh = await Mesh().start(tiny_model("llama"))
        try:
            engine = mesh.node.llm_engine
            step = engine.step
            want = [t async for m in mesh.generate("warm", 12) for t in m.token_ids]
            release = asyncio.Event()
            loop = asyncio.get_running_loop()

            def hung_step():          # one step that hangs until the test lets it go
                engine.step = step
                asyncio.run_coroutine_threadsafe(release.wait(), loop).result()
                return step()
            engine.step = hung_step
            call = mesh.generate("hung", 12)
            reader = asyncio.ensure_future(_tokens(call))
            await mesh.wait(lambda: _eq(mesh.health(), health_pb2.HealthCheckResponse.NOT_SERVING),
                            "NOT_SERVING")
            await mesh.wait(lambda: _stalled(mesh, True), "load.stalled at the meta-server")
            assert await mesh.route() == grpc.StatusCode.UNAVAILABLE       # routed to no more
            release.set()
            assert await reader == want                                     # the request went on
            await mesh.wait(lambda: _eq(mesh.health(), health_pb2.HealthCheckResponse.SERVING), "SERVING")
            await mesh.wait(lambda: _stalled(mesh, False), "load.stalled cleared")
            assert await mesh.route() == grpc.StatusCode.OK
            assert not mesh.node_server.health.failed.is_set()
            assert engine.stats()["used_blocks"] == 0
        finally:
            await mesh.close()

    asyncio.run(scenario())


def test_a_dead_engine_fails_its_streams_unavailable_and_deregisters_from_the_mesh(tiny_model):
    """With a lease longer than any wait, leaving the mesh is the node's own Deregister."""
    async def scenario():
        mesh = await Mesh().start(tiny_model("llama"), ttl=LONG_TTL)
        try:
            call = mesh.generate("doomed", 400)
            first = await call.read()                 # streaming
            assert first.token_ids
            _fail_next_step(mesh.node.llm_engine)
            died = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                while await call.read() is not grpc.aio.EOF:
                    pass
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "injected step failure" in err.value.details()
            await mesh.wait(lambda: _eq(mesh.health(), health_pb2.HealthCheckResponse.NOT_SERVING), "NOT_SERVING")
            await mesh.wait(lambda: _eq(mesh.members(), []), "leaving the mesh")
            print(f"left the mesh {time.monotonic() - died:.2f} s after the step failed (target: 1 s)")
            assert mesh.node_server.health.failed.is_set()
            with pytest.raises(grpc.aio.AioRpcError) as err:   # a new request fails fast, retryably
                await _tokens(mesh.generate("late", 4))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            await mesh.close()

    asyncio.run(scenario())


async def _tokens(call) -> list[int]:
    return [t async for m in call for t in m.token_ids]


async def _eq(coro, value) -> bool:
    return await coro == value


async def _stalled(mesh: Mesh, value: bool) -> bool:
    return [n.load.stalled for n in await mesh.members()] == [value]


def test_commands_left_waiting_make_the_node_not_serving(tiny_model):
    """A step thread that stops draining the inbox (here: the engine lock held elsewhere,
    as a deadlock would) leaves a command waiting: NOT_SERVING until it runs."""
    async def scenario():
        mesh = await Mesh().start(tiny_model("llama"))
        try:
            engine = mesh.node.engine
            lock = engine._engine_lock
            await asyncio.to_thread(lock.acquire)
            try:
                stats = asyncio.ensure_future(engine.stats())       # queued: nobody drains it
                await mesh.wait(lambda: _eq(mesh.health(), health_pb2.HealthCheckResponse.NOT_SERVING),
                                "NOT_SERVING")
            finally:
                lock.release()
            assert (await stats)["used_blocks"] == 0
            await mesh.wait(lambda: _eq(mesh.health(), health_pb2.HealthCheckResponse.SERVING), "SERVING")
        finally:
            await mesh.close()

    asyncio.run(scenario())
