"""A mesh whose membership lives in etcd (real etcd, real processes): nodes join through
their leases, an etcd outage while requests flow fails no request, and a standby
meta-server leads within one TTL of the leader's kill -9."""
from __future__ import annotations

import asyncio
import time

import grpc

from protos.pdmesh.v1 import meta_pb2, meta_pb2_grpc
from tests.etcd_server import EtcdServer
from tests.integration.test_mesh import assert_no_blocks_in_use, request, stream
from tests.channels import operator_channel_sync

TTL = 2.0


def listed(mesh) -> set[str]:
    with operator_channel_sync(mesh.meta_address) as ch:
        nodes = meta_pb2_grpc.MetaServerStub(ch).ListMembers(meta_pb2.ListMembersRequest(), timeout=5).nodes
    return {n.node_id for n in nodes}


def test_etcd_outage_while_serving(tiny_model, start_mesh, tmp_path):
    with EtcdServer(tmp_path / "etcd") as etcd:
        mesh = start_mesh(tiny_model("llama"), top={"etcd_endpoint": etcd.endpoint, "cluster": "itest"},
                          ttl_seconds=TTL)
        assert listed(mesh) == {"prefill-0", "decode-0"}
        expected, _, _ = asyncio.run(stream(mesh.gateway_address, request([7, 8, 9, 10] * 20, max_tokens=8)))

        async def traffic(seconds: float) -> list:
            results, deadline = [], time.monotonic() + seconds
            while time.monotonic() < deadline:
                tokens, _, msgs = await stream(mesh.gateway_address, request([7, 8, 9, 10] * 20, max_tokens=8))
                results.append((tokens, msgs[-1].finish_reason))
                await asyncio.sleep(0.2)
            return results

        async def outage():
            task = asyncio.create_task(traffic(14.0))
            await asyncio.sleep(1.0)
            await asyncio.to_thread(etcd.stop)
            await asyncio.sleep(10.0)
            await asyncio.to_thread(etcd.start)
            return await task

        results = asyncio.run(outage())
        assert len(results) >= 10
        assert all(r == (expected, "length") for r in results)
        deadline = time.monotonic() + TTL + 1.0
        while listed(mesh) != {"prefill-0", "decode-0"}:
            assert time.monotonic() < deadline, f"listed after restart: {listed(mesh)}"
            time.sleep(0.1)
        assert_no_blocks_in_use(mesh)
        mesh.stop()


def admin_call(address: str, method: str, request, timeout: float = 5.0):
    with operator_channel_sync(address) as ch:
        return getattr(meta_pb2_grpc.MetaAdminStub(ch), method)(request, timeout=timeout)


def leads(address: str) -> bool:
    """Whether the meta-server takes a leader-only call (SetPolicy to the policy in force)."""
    try:
        admin_call(address, "SetPolicy", meta_pb2.SetPolicyRequest(policy="round_robin"), timeout=0.5)
        return True
    except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.FAILED_PRECONDITION:
            raise
        return False


def test_leader_meta_server_killed(tiny_model, start_mesh, tmp_path):
    """The election lease is half the TTL (common.cluster.election_ttl_seconds): the worst
    takeover is 1 s + etcd's 0.5 s expiry sweep, so "within TTL" keeps 0.5 s to spare."""
    with EtcdServer(tmp_path / "etcd") as etcd:
        mesh = start_mesh(tiny_model("llama"), top={"etcd_endpoint": etcd.endpoint, "cluster": "failover"},
                          nodes=[("decode", "decode-0"), ("decode", "decode-1")], ttl_seconds=TTL, standbys=1)
        metas = {name: mesh.services[name].address for name in ("meta-server", "meta-server-1")}
        leaders = []
        for name, address in metas.items():
            try:
                admin_call(address, "SetPolicy", meta_pb2.SetPolicyRequest(policy="round_robin"))
                leaders.append(name)
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.FAILED_PRECONDITION and "standby" in e.details()
        assert len(leaders) == 1, leaders
        leader = leaders[0]
        admin_call(metas[leader], "DrainNode", meta_pb2.DrainNodeRequest(node_id="decode-1"))
        before, _, _ = asyncio.run(stream(mesh.gateway_address, request([7, 8, 9], max_tokens=5)))
        standby = next(address for name, address in metas.items() if name != leader)
        mesh.kill(leader)
        killed = time.monotonic()
        while not leads(standby) and time.monotonic() - killed < TTL:
            time.sleep(0.01)
        took = time.monotonic() - killed
        print(f"standby led {took:.2f}s after kill -9 of the leader (ttl {TTL}s)")
        assert took < TTL
        tokens, _, msgs = asyncio.run(stream(mesh.gateway_address, request([7, 8, 9], max_tokens=5)))
        assert tokens == before and msgs[-1].finish_reason == "length"
        assert admin_call(standby, "GetPolicy", meta_pb2.GetPolicyRequest()).policy == "round_robin"
        nodes = {n.info.node_id: n.state for n in
                 admin_call(standby, "ListNodes", meta_pb2.ListNodesRequest()).nodes}
        assert nodes == {"decode-0": "up", "decode-1": "draining"}
        stats = admin_call(standby, "GetStats", meta_pb2.GetStatsRequest())
        assert stats.num_routed == 1
        assert [(n.node_id, n.num_routed) for n in stats.nodes] == [("decode-0", 1)]
        mesh.stop()
