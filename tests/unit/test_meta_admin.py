"""MetaAdmin in-process over a real gRPC channel (create_server on port 0): node states
up -> draining -> down -> forgotten, drain/undrain/remove, policy, stats, status codes,
health and reflection, and the `pdmesh admin` CLI against it; leadership with a fake
election (who may route, a new leader's admin state reload)."""
from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from common.config import MetaConfig
from protos.pdmesh.v1 import common_pb2, meta_pb2, meta_pb2_grpc
from services.meta_server.server import create_server
from tests.channels import operator_channel, operator_channel_sync

TTL = 2.0


def node(node_id: str, role: str) -> common_pb2.NodeInfo:
    return common_pb2.NodeInfo(node_id=node_id, role=role, address=f"127.0.0.1:{hash(node_id) % 1000 + 1}",
                               model_id="m", kv_layout=common_pb2.KVLayout(block_size=16, num_blocks=64),
                               load=common_pb2.NodeLoad(free_blocks=60, total_blocks=64))


def run_with_meta(test, admin_state=None, **cfg):
    """test(meta_stub, admin_stub, server, clock, address) on a fresh meta-server whose
    registry reads the mutable fake clock [t]."""
    async def main():
        server, port = await create_server(MetaConfig(port=0, ttl_seconds=TTL, **cfg),
                                           admin_state=admin_state)
        clock = [100.0]
        server.control.registry.clock = lambda: clock[0]
        address = f"127.0.0.1:{port}"
        try:
            async with operator_channel(address) as ch:
                meta, admin = meta_pb2_grpc.MetaServerStub(ch), meta_pb2_grpc.MetaAdminStub(ch)
                for node_id, role in (("p0", "prefill"), ("d0", "decode"), ("d1", "decode")):
                    await meta.Register(meta_pb2.RegisterRequest(node=node(node_id, role)))
                await test(meta, admin, server, clock, address)
        finally:
            await server.stop(0)
    asyncio.run(main())


async def states(admin) -> dict[str, str]:
    return {n.info.node_id: n.state for n in (await admin.ListNodes(meta_pb2.ListNodesRequest())).nodes}


async def route(meta, n: int = 1) -> list[str]:
    out = []
    for _ in range(n):
        r = await meta.Route(meta_pb2.RouteRequest(model_id="m", num_prompt_tokens=100))
        out.append(r.decode.node_id)
    return out


def test_list_nodes_then_ttl_expiry_marks_down_then_forgets():
    async def test(meta, admin, server, clock, _):
        reply = await admin.ListNodes(meta_pb2.ListNodesRequest())
        assert [(n.info.node_id, n.info.role, n.state) for n in reply.nodes] == [
            ("p0", "prefill", "up"), ("d0", "decode", "up"), ("d1", "decode", "up")]
        assert reply.nodes[1].info.load.free_blocks == 60 and reply.nodes[1].info.model_id == "m"
        clock[0] += TTL * 0.9
        await meta.Heartbeat(meta_pb2.HeartbeatRequest(node_id="d1", load=node("d1", "decode").load))
        await meta.Heartbeat(meta_pb2.HeartbeatRequest(node_id="p0", load=node("p0", "prefill").load))
        clock[0] += TTL * 0.2
        assert await states(admin) == {"p0": "up", "d0": "down", "d1": "up"}
        assert await route(meta, 3) == ["d1"] * 3
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await meta.Heartbeat(meta_pb2.HeartbeatRequest(node_id="d0"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        members = await meta.ListMembers(meta_pb2.ListMembersRequest())
        assert sorted(n.node_id for n in members.nodes) == ["d1", "p0"]
        clock[0] += 10 * TTL + 0.1
        assert "d0" not in await states(admin)
    run_with_meta(test)


def test_drain_undrain_and_stats():
    async def test(meta, admin, server, clock, _):
        reply = await admin.DrainNode(meta_pb2.DrainNodeRequest(node_id="d0"))
        assert reply.node.state == "draining" and reply.node.info.node_id == "d0"
        assert await states(admin) == {"p0": "up", "d0": "draining", "d1": "up"}
        assert await route(meta, 4) == ["d1"] * 4
        await admin.UndrainNode(meta_pb2.UndrainNodeRequest(node_id="d0"))
        await admin.SetPolicy(meta_pb2.SetPolicyRequest(policy="round_robin"))
        assert await route(meta, 2) == ["d0", "d1"]
        stats = await admin.GetStats(meta_pb2.GetStatsRequest())
        assert (stats.policy, stats.num_routed, stats.num_local_prefill) == ("round_robin", 6, 0)
        assert [(n.node_id, n.role, n.num_routed) for n in stats.nodes] == [
            ("d0", "decode", 1), ("d1", "decode", 5), ("p0", "prefill", 6)]
        assert (stats.free_blocks, stats.total_blocks) == (180, 192)
        listed = (await admin.ListNodes(meta_pb2.ListNodesRequest())).nodes
        assert [n.num_routed for n in listed] == [6, 1, 5]
    run_with_meta(test)


def test_drained_node_stays_drained_when_it_registers_again():
    async def test(meta, admin, server, clock, _):
        await admin.DrainNode(meta_pb2.DrainNodeRequest(node_id="d0"))
        clock[0] += TTL + 0.1                     # d0 (and everyone) down, then d0 restarts
        await meta.Register(meta_pb2.RegisterRequest(node=node("d0", "decode")))
        assert (await states(admin))["d0"] == "draining"
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await route(meta)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    run_with_meta(test)


def test_remove_forgets_a_node_until_it_registers_again():
    async def test(meta, admin, server, clock, _):
        await admin.DrainNode(meta_pb2.DrainNodeRequest(node_id="d0"))
        await route(meta, 2)
        await admin.RemoveNode(meta_pb2.RemoveNodeRequest(node_id="d1"))
        await admin.RemoveNode(meta_pb2.RemoveNodeRequest(node_id="d0"))
        assert await states(admin) == {"p0": "up"}
        stats = await admin.GetStats(meta_pb2.GetStatsRequest())
        assert [n.node_id for n in stats.nodes] == ["p0"] and stats.num_routed == 2
        with pytest.raises(grpc.aio.AioRpcError) as err:    # still alive: told to register
            await meta.Heartbeat(meta_pb2.HeartbeatRequest(node_id="d0"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        await meta.Register(meta_pb2.RegisterRequest(node=node("d0", "decode")))
        assert await states(admin) == {"p0": "up", "d0": "up"}   # back, undrained
        assert await route(meta) == ["d0"]
    run_with_meta(test)


@pytest.mark.parametrize("rpc,request_cls", [("DrainNode", meta_pb2.DrainNodeRequest),
                                             ("UndrainNode", meta_pb2.UndrainNodeRequest),
                                             ("RemoveNode", meta_pb2.RemoveNodeRequest)])
def test_unknown_node_is_not_found(rpc, request_cls):
    async def test(meta, admin, server, clock, _):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await getattr(admin, rpc)(request_cls(node_id="nope"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and "'nope'" in err.value.details()
    run_with_meta(test)


def test_policy_get_set_and_invalid():
    async def test(meta, admin, server, clock, _):
        reply = await admin.GetPolicy(meta_pb2.GetPolicyRequest())
        assert reply.policy == "cache_aware"
        assert list(reply.allowed) == ["cache_aware", "least_load", "round_robin"]
        assert (await admin.SetPolicy(meta_pb2.SetPolicyRequest(policy="least_load"))).policy == "least_load"
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await admin.SetPolicy(meta_pb2.SetPolicyRequest(policy="fastest"))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "['cache_aware', 'least_load', 'round_robin']" in err.value.details()
        assert "'fastest'" in err.value.details()
        assert (await admin.GetPolicy(meta_pb2.GetPolicyRequest())).policy == "least_load"
    run_with_meta(test, policy="cache_aware")


def test_health_and_reflection_list_both_services():
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase)

    async def test(meta, admin, server, clock, address):
        def check():
            with operator_channel_sync(address) as ch:
                for name in ("pdmesh.v1.MetaServer", "pdmesh.v1.MetaAdmin"):
                    status = health_pb2_grpc.HealthStub(ch).Check(
                        health_pb2.HealthCheckRequest(service=name), timeout=5).status
                    assert status == health_pb2.HealthCheckResponse.SERVING
                return set(ProtoReflectionDescriptorDatabase(ch).get_services())
        services = await asyncio.to_thread(check)
        assert {"pdmesh.v1.MetaServer", "pdmesh.v1.MetaAdmin", "grpc.health.v1.Health"} <= services
    run_with_meta(test)


def test_cli_tables_json_and_errors(capsys):
    from services.cli import main

    async def test(meta, admin, server, clock, address):
        await route(meta, 3)
        cli = lambda *argv: asyncio.to_thread(main, ["admin", *argv, "--meta", address])
        assert await cli("nodes") == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines[0].split()[:4] == ["NODE", "ROLE", "STATE", "ADDRESS"]
        assert [line.split()[:3] for line in lines[1:]] == [
            ["p0", "prefill", "up"], ["d0", "decode", "up"], ["d1", "decode", "up"]]
        assert await cli("drain", "d1", "--json") == 0
        assert json.loads(capsys.readouterr().out)["state"] == "draining"
        assert await cli("nodes", "--json") == 0
        nodes = json.loads(capsys.readouterr().out)
        assert [(n["node_id"], n["state"]) for n in nodes] == [("p0", "up"), ("d0", "up"), ("d1", "draining")]
        assert await cli("undrain", "d1") == 0
        assert capsys.readouterr().out.strip() == "d1: up (0 running, 0 waiting)"
        assert await cli("policy", "round_robin") == 0
        assert "policy: round_robin" in capsys.readouterr().out
        assert await cli("stats", "--json") == 0
        stats = json.loads(capsys.readouterr().out)
        assert stats["num_routed"] == 3 and stats["policy"] == "round_robin"
        assert await cli("stats") == 0
        assert "requests routed: 3" in capsys.readouterr().out
        assert await cli("remove", "d0") == 0
        assert capsys.readouterr().out.strip() == "d0: removed"
        assert await cli("drain", "ghost") == 1
        assert "NOT_FOUND" in capsys.readouterr().err
        assert await cli("policy", "bogus") == 2
        assert "INVALID_ARGUMENT" in capsys.readouterr().err
    run_with_meta(test)


class FakeAdminStore:
    """The AdminStore contract (common.cluster.base) over a dict; `down` makes every call
    raise like StoreUnavailableError (a RuntimeError)."""

    def __init__(self):
        self.data: dict[str, bytes] = {}
        self.down = False

    def _check(self):
        if self.down:
            raise RuntimeError("store down")

    async def get(self, name):
        self._check()
        return self.data.get(name)

    async def put(self, name, value):
        self._check()
        self.data[name] = value

    async def delete(self, name):
        self._check()
        return self.data.pop(name, None) is not None

    async def list(self, prefix=""):
        self._check()
        return {k: v for k, v in self.data.items() if k.startswith(prefix)}


def test_store_backed_admin_state_survives_a_restart_and_reports_a_down_store():
    from services.meta_server.admin_state import StoreAdminState
    store = FakeAdminStore()

    async def first(meta, admin, server, clock, _):
        await admin.SetPolicy(meta_pb2.SetPolicyRequest(policy="round_robin"))
        await admin.DrainNode(meta_pb2.DrainNodeRequest(node_id="d0"))
        assert store.data == {"policy": b"round_robin", "drained/d0": b"1"}
        store.down = True
        for call in (admin.DrainNode(meta_pb2.DrainNodeRequest(node_id="d1")),
                     admin.RemoveNode(meta_pb2.RemoveNodeRequest(node_id="d0")),
                     admin.SetPolicy(meta_pb2.SetPolicyRequest(policy="least_load"))):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert await states(admin) == {"p0": "up", "d0": "draining", "d1": "up"}
        assert (await admin.GetPolicy(meta_pb2.GetPolicyRequest())).policy == "round_robin"
        store.down = False

    async def restarted(meta, admin, server, clock, _):      # a new meta-server, same store
        assert (await admin.GetPolicy(meta_pb2.GetPolicyRequest())).policy == "round_robin"
        assert await states(admin) == {"p0": "up", "d0": "draining", "d1": "up"}
        assert await route(meta, 2) == ["d1", "d1"]
        await admin.UndrainNode(meta_pb2.UndrainNodeRequest(node_id="d0"))
        assert store.data == {"policy": b"round_robin"}

    run_with_meta(first, admin_state=StoreAdminState(store, "least_load"))
    run_with_meta(restarted, admin_state=StoreAdminState(store, "least_load"))


class FakeElection:
    """A LeaderElection whose state the test sets; campaign() wins at once."""

    def __init__(self, on_change=None):
        self.on_change = on_change
        self.is_leader = self.was_leader = False
        self.ttl_s = None

    async def campaign(self, candidate_id, ttl_s):
        self.ttl_s, self.is_leader = ttl_s, True
        self.on_change(True)


class FakeCluster:
    def election(self, on_change):
        self.elected = FakeElection(on_change)
        return self.elected


def control_with(admin_state):
    from services.meta_server.control import MetaControl
    from services.meta_server.registry import EmbeddedRegistry
    from services.meta_server.router import Router
    return MetaControl(EmbeddedRegistry(), Router(), admin_state)


@pytest.mark.parametrize("is_leader,was_leader,ready,reason", [
    (True, False, True, None),
    (True, False, False, "meta-server m:1 is taking over; retry"),
    (False, True, True, None),                 # led when etcd went away: keeps routing
    (False, False, True, "meta-server m:1 is a standby; another meta-server leads"),
])
def test_standby_reason_follows_the_election(is_leader, was_leader, ready, reason):
    from services.meta_server.admin_state import InMemoryAdminState
    control = control_with(InMemoryAdminState("least_load"))
    assert control.standby_reason() is None    # no election: the only meta-server
    control.election, control.candidate_id, control.leader_ready = FakeElection(), "m:1", ready
    control.election.is_leader, control.election.was_leader = is_leader, was_leader
    assert control.standby_reason() == reason


def test_a_new_leader_campaigns_on_half_the_ttl_and_reloads_the_admin_state_when_etcd_answers():
    from services.meta_server.admin_state import StoreAdminState
    from services.meta_server.server import campaign
    store = FakeAdminStore()

    async def main():
        control = control_with(StoreAdminState(store, "least_load"))
        control.candidate_id = "m:1"
        store.down = True
        cluster = FakeCluster()
        await campaign(control, cluster, ttl_s=5.0)
        assert cluster.elected.ttl_s == 2
        await asyncio.sleep(0.3)                   # the reload keeps failing: no routing yet
        assert control.standby_reason() == "meta-server m:1 is taking over; retry"
        store.data["policy"], store.down = b"round_robin", False
        await asyncio.wait_for(control.take_over_task, 5)
        assert control.standby_reason() is None and control.policy() == "round_robin"
    asyncio.run(main())
