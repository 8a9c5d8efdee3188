"""A request that finds no decode node waits for one (timeouts.node_wait_s, never past its
deadline) instead of failing at once: served when a node registers meanwhile, routed again
to a node it failed on once that exclusion lapsed, UNAVAILABLE when none comes; a full mesh
(RESOURCE_EXHAUSTED) is not waited for. The waits are counted in the gateway's metrics
(services/gateway/request_stream.py, metrics.py)."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from common.timeouts import TimeoutConfig
from tests.gateway_mesh import FakeDecode, Mesh
from tests.gateway_requests import request

pytestmark = pytest.mark.timeout(120)
WAITS = "pdmesh:node_wait_seconds_count"
WAITED_S = "pdmesh:node_wait_seconds_sum"
WAITING = "pdmesh:num_requests_waiting_for_node"


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama")


def sample(mesh: Mesh, name: str) -> float:
    return mesh.gateway.metrics.registry.get_sample_value(name)


def test_a_request_waits_for_a_node_that_registers_and_is_served(model):
    async def scenario():
        async with Mesh(model, timeouts=TimeoutConfig(node_wait_s=20.0)) as mesh:
            call = asyncio.ensure_future(mesh.generate(request(max_tokens=4)))
            while sample(mesh, WAITING) != 1:            # it is waiting (no node yet)
                assert not call.done(), call
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.3)
            await mesh.add_decode(FakeDecode())
            replies = await call
            return replies, sample(mesh, WAITS), sample(mesh, WAITED_S), sample(mesh, WAITING)

    replies, waits, waited_s, waiting = asyncio.run(scenario())
    assert [t for r in replies for t in r.token_ids] == [10, 11, 12, 13] and replies[-1].finish_reason == "length"
    assert (waits, waiting) == (1, 0) and waited_s >= 0.3


def test_no_node_within_node_wait_s_is_unavailable_after_the_wait(model):
    async def scenario():
        async with Mesh(model, timeouts=TimeoutConfig(node_wait_s=0.5)) as mesh:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await mesh.generate(request())
            return err.value, sample(mesh, WAITS), sample(mesh, WAITED_S), sample(mesh, WAITING)

    err, waits, waited_s, waiting = asyncio.run(scenario())
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert err.details().startswith("no decode node is available now; retry later (error id ")
    assert (waits, waiting) == (1, 0) and waited_s >= 0.4       # from its first answer to the wait's end


def test_a_node_the_request_failed_on_is_routed_to_again_once_its_exclusion_lapsed(model):
    """The only node refuses the first call (UNAVAILABLE: it was restarting): the request
    keeps off it for the lapse (0.5 s here; the membership TTL in a mesh), waiting, then
    routes to it again and is served."""
    node = FakeDecode((grpc.StatusCode.UNAVAILABLE, "restarting"), fail_calls=1)

    async def scenario():
        async with Mesh(model, decode=node, timeouts=TimeoutConfig(node_wait_s=20.0), exclusion_lapse_s=0.5) as mesh:
            replies = await mesh.generate(request(max_tokens=3))
            return replies, sample(mesh, WAITS), sample(mesh, WAITED_S)

    replies, waits, waited_s = asyncio.run(scenario())
    assert [t for r in replies for t in r.token_ids] == [10, 11, 12]
    assert node.calls == 2 and waits == 1 and waited_s >= 0.5 * 0.9


def test_a_full_mesh_is_not_waited_for(model):
    node = FakeDecode((grpc.StatusCode.RESOURCE_EXHAUSTED, "decode node decode-0 has 64 requests waiting"))

    async def scenario():
        async with Mesh(model, decode=node, timeouts=TimeoutConfig(node_wait_s=20.0)) as mesh:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await mesh.generate(request())
            return err.value, sample(mesh, WAITS)

    err, waits = asyncio.run(scenario())
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and waits == 0 and node.calls == 1


def test_a_node_that_keeps_refusing_ends_the_wait_at_node_wait_s_not_the_deadline(model):
    """Refused again every time its exclusion lapses (it heartbeats but the gateway cannot
    reach it): the wait is the request's, so it ends UNAVAILABLE after node_wait_s (1 s)
    with a bounded number of tries, not at the client's 20 s deadline."""
    node = FakeDecode((grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses"))

    async def scenario():
        async with Mesh(model, decode=node, timeouts=TimeoutConfig(node_wait_s=1.0), exclusion_lapse_s=0.2) as mesh:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await mesh.generate(request(), timeout=20)
            return err.value

    err = asyncio.run(scenario())
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert err.details().startswith("no decode node is available now; retry later (error id ")
    assert 2 <= node.calls <= 15


def test_a_meta_server_that_is_down_ends_the_wait_unavailable_within_node_wait_s(model):
    """The meta client follows the leader for meta_follow_s (8 s) a call; the wait (1 s)
    bounds those calls too, so the client hears UNAVAILABLE, not its own 6 s deadline."""
    async def scenario():
        async with Mesh(model, timeouts=TimeoutConfig(node_wait_s=1.0)) as mesh:
            await mesh.meta.stop(None)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await mesh.generate(request(), timeout=6)
            return err.value

    err = asyncio.run(scenario())
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert err.details().startswith("the mesh cannot route requests now; retry later (error id ")


def test_a_client_deadline_sooner_than_the_wait_still_hears_unavailable(model):
    """No poll left before the client's 1 s deadline: UNAVAILABLE (what retry policies
    retry), not DEADLINE_EXCEEDED."""
    async def scenario():
        async with Mesh(model, timeouts=TimeoutConfig(node_wait_s=20.0)) as mesh:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await mesh.generate(request(), timeout=1.0)
            return err.value

    err = asyncio.run(scenario())
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert err.details().startswith("no decode node is available now; retry later (error id ")
