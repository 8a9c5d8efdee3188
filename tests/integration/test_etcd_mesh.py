"""A mesh whose membership lives in etcd (real etcd, real processes): nodes join through
their leases, an etcd outage while requests flow fails no request, and a standby
meta-server takes the lead after the leader's kill -9."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from protos.pdmesh.v1 import meta_pb2, meta_pb2_grpc
from tests.etcd_server import EtcdServer
from tests.integration.test_mesh import assert_no_blocks_in_use, request, stream
from tests.channels import operator_channel_sync

TTL = 2.0
# Bound of the waits below: it only catches a hang (a loaded machine is slower, never this
# slow); the seconds taken are printed, not asserted.
HANG_GUARD_S = 60.0
OUTAGE_S = 10.0       # at least this long: several TTLs, so that every lease would have lapsed
PER_PHASE = 3         # requests that start and finish before, during and after the outage


def listed(mesh) -> set[str]:
    with operator_channel_sync(mesh.meta_address) as ch:
        nodes = meta_pb2_grpc.MetaServerStub(ch).ListMembers(meta_pb2.ListMembersRequest(), timeout=5).nodes
    return {n.node_id for n in nodes}


def test_etcd_outage_while_serving(tiny_model, start_mesh, tmp_path):
    """Requests that start and finish while etcd is down are served like the others; once
    etcd is back both nodes are listed again."""
    with EtcdServer(tmp_path / "etcd") as etcd:
        mesh = start_mesh(tiny_model("llama"), top={"etcd_endpoint": etcd.endpoint, "cluster": "itest"},
                          ttl_seconds=TTL)
        try:
            assert listed(mesh) == {"prefill-0", "decode-0"}
            expected, _, _ = asyncio.run(stream(mesh.gateway_address, request([7, 8, 9, 10] * 20, max_tokens=8)))
            phase = "before"
            results = []          # (phase at its start, phase at its end, tokens, finish reason)

            def served_in(p: str) -> int:
                return sum(1 for start, end, _, _ in results if start == end == p)

            async def traffic(done: asyncio.Event) -> None:
                while not done.is_set():
                    started = phase
                    tokens, _, msgs = await stream(mesh.gateway_address, request([7, 8, 9, 10] * 20, max_tokens=8))
                    results.append((started, phase, tokens, msgs[-1].finish_reason))
                    await asyncio.sleep(0.2)

            async def until_served(p: str, at_least_s: float = 0.0) -> None:
                start = time.monotonic()
                while served_in(p) < PER_PHASE or time.monotonic() - start < at_least_s:
                    assert time.monotonic() - start < max(at_least_s, HANG_GUARD_S), f"hung: {results}"
                    await asyncio.sleep(0.1)

            async def outage():
                nonlocal phase
                done = asyncio.Event()
                task = asyncio.create_task(traffic(done))
                await until_served("before")
                await asyncio.to_thread(etcd.stop)
                phase = "outage"
                await until_served("outage", at_least_s=OUTAGE_S)
                phase = "restarting"
                await asyncio.to_thread(etcd.start)
                phase = "after"
                await until_served("after")
                done.set()
                await task

            asyncio.run(outage())
            print(f"requests served before/during/after the outage: "
                  f"{[served_in(p) for p in ('before', 'outage', 'after')]} of {len(results)}")
            assert all((tokens, reason) == (expected, "length") for _, _, tokens, reason in results)
            restarted = time.monotonic()
            while listed(mesh) != {"prefill-0", "decode-0"}:
                assert time.monotonic() - restarted < HANG_GUARD_S, f"listed after restart: {listed(mesh)}"
                time.sleep(0.1)
            print(f"both nodes listed again {time.monotonic() - restarted:.2f}s after the last requests")
            assert_no_blocks_in_use(mesh, timeout_s=HANG_GUARD_S)
        finally:
            mesh.stop()


def admin_call(address: str, method: str, request, timeout: float = 5.0):
    with operator_channel_sync(address) as ch:
        return getattr(meta_pb2_grpc.MetaAdminStub(ch), method)(request, timeout=timeout)


NO_SUCH_NODE = "no-such-node"


def leads(address: str) -> bool:
    """Whether the meta-server takes a leader-only call, asked with one that changes
    nothing: draining a node nobody has is NOT_FOUND on the leader, FAILED_PRECONDITION
    on a standby (which refuses every change before looking at it)."""
    try:
        admin_call(address, "DrainNode", meta_pb2.DrainNodeRequest(node_id=NO_SUCH_NODE))
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.NOT_FOUND:
            return True
        if e.code() != grpc.StatusCode.FAILED_PRECONDITION:
            raise
        return False
    raise AssertionError(f"{address} drained {NO_SUCH_NODE!r}")


def test_leader_meta_server_killed(tiny_model, start_mesh, tmp_path):
    """The standby takes the lead (it answers a leader-only call) with the leader's admin
    state (policy, drained node) and the members from etcd, and routes the next request."""
    with EtcdServer(tmp_path / "etcd") as etcd:
        mesh = start_mesh(tiny_model("llama"), top={"etcd_endpoint": etcd.endpoint, "cluster": "failover"},
                          nodes=[("decode", "decode-0"), ("decode", "decode-1")], ttl_seconds=TTL, standbys=1)
        try:
            metas = {name: mesh.services[name].address for name in ("meta-server", "meta-server-1")}
            leaders = [name for name, address in metas.items() if leads(address)]
            assert len(leaders) == 1, leaders
            leader = leaders[0]
            # admin state the standby must find in etcd: a policy other than the default, a drain
            admin_call(metas[leader], "SetPolicy", meta_pb2.SetPolicyRequest(policy="round_robin"))
            standby_name = next(name for name in metas if name != leader)
            with pytest.raises(grpc.RpcError) as refused:
                admin_call(metas[standby_name], "SetPolicy", meta_pb2.SetPolicyRequest(policy="cache_aware"))
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "standby" in refused.value.details()
            admin_call(metas[leader], "DrainNode", meta_pb2.DrainNodeRequest(node_id="decode-1"))
            before, _, _ = asyncio.run(stream(mesh.gateway_address, request([7, 8, 9], max_tokens=5)))
            standby = next(address for name, address in metas.items() if name != leader)
            mesh.kill(leader)
            killed = time.monotonic()
            while not leads(standby):
                assert time.monotonic() - killed < HANG_GUARD_S, "the standby never took the lead"
                time.sleep(0.01)
            print(f"standby led {time.monotonic() - killed:.2f}s after kill -9 of the leader (ttl {TTL}s)")
            tokens, _, msgs = asyncio.run(stream(mesh.gateway_address, request([7, 8, 9], max_tokens=5)))
            assert tokens == before and msgs[-1].finish_reason == "length"
            assert admin_call(standby, "GetPolicy", meta_pb2.GetPolicyRequest()).policy == "round_robin"
            nodes = {n.info.node_id: n.state for n in
                     admin_call(standby, "ListNodes", meta_pb2.ListNodesRequest()).nodes}
            assert nodes == {"decode-0": "up", "decode-1": "draining"}
            stats = admin_call(standby, "GetStats", meta_pb2.GetStatsRequest())
            assert stats.num_routed == 1
            assert [(n.node_id, n.num_routed) for n in stats.nodes] == [("decode-0", 1)]
        finally:
            mesh.stop()
