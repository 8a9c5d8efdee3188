"""The Registry contract (services/meta_server/registry/base.py), the same tests against
both implementations, each fed the way its nodes feed it:

  embedded  EmbeddedRegistry; nodes call register / heartbeat (register again when the
            heartbeat is refused) / deregister, as RpcRegistration does over gRPC.
  etcd      EtcdRegistry on a real etcd (tests/etcd_server.py); nodes keep their keys on
            leases with common.cluster Memberships, as EtcdRegistration does.

The registry's clock is a fake that moves only when a test says so (etcd leases still
expire in real time). Exact outcomes: member order, states, infos, join callbacks.
"""
from __future__ import annotations

import asyncio
import itertools

import pytest

from protos.pdmesh.v1 import common_pb2
from services.meta_server.registry import (DOWN, UP, EmbeddedRegistry, EtcdRegistry, RegistrationConflictError,
                                           RegistrationRefusedError)
from tests.etcd_server import EtcdServer, etcd_server, loop, run, wait_until  # noqa: F401  (fixtures)

TTL = 1.0           # seconds; etcd leases count whole seconds
STEP = 0.25         # fake seconds between two reports of a live node (< TTL/3 + a bit)
pytestmark = pytest.mark.timeout(90)
_clusters = itertools.count()


def info(node_id: str, role: str, running: int = 0, waiting: int = 0) -> common_pb2.NodeInfo:
    return common_pb2.NodeInfo(node_id=node_id, role=role, address=f"{node_id}:1", model_id="m",
                               load=common_pb2.NodeLoad(running=running, waiting=waiting,
                                                        free_blocks=64, total_blocks=64))


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def now(self) -> float:
        return self.t


class Nodes:
    """Nodes feeding one registry. live: the last info of every node that still reports."""

    def __init__(self, registry, clock: FakeClock):
        self.registry, self.clock = registry, clock
        self.joined: list[str] = []
        registry.on_join = self.joined.append
        self.live: dict[str, common_pb2.NodeInfo] = {}

    async def pass_time(self, seconds: float) -> None:
        """`seconds` of the fake clock go by while every live node reports each STEP."""
        for _ in range(round(seconds / STEP)):
            self.clock.t += STEP
            for node in list(self.live.values()):
                await self.report(node)


class EmbeddedNodes(Nodes):
    kind = "embedded"

    def __init__(self, clock: FakeClock):
        super().__init__(EmbeddedRegistry(default_ttl_s=TTL, clock=clock.now), clock)

    async def join(self, node: common_pb2.NodeInfo) -> None:
        assert self.registry.register(node) == TTL
        self.live[node.node_id] = node

    async def report(self, node: common_pb2.NodeInfo) -> None:
        self.live[node.node_id] = node
        if not self.registry.heartbeat(node.node_id, node.load):
            self.registry.register(node)

    async def crash(self, node_id: str) -> None:
        """Stops reporting; the others report until it is past its TTL."""
        del self.live[node_id]
        await self.pass_time(TTL + STEP)

    async def leave(self, node_id: str) -> None:
        del self.live[node_id]
        assert self.registry.deregister(node_id)

    async def close(self) -> None:
        await self.registry.close()


class EtcdNodes(Nodes):
    kind = "etcd"

    def __init__(self, clock: FakeClock, server: EtcdServer, cluster: str):
        from common.cluster.etcd import EtcdCluster, EtcdConfig
        cfg = EtcdConfig(endpoint=server.endpoint, cluster=cluster, timeout_s=1.0, retry_max_s=0.5)
        self.meta, self.nodes = EtcdCluster(cfg), EtcdCluster(cfg)   # meta-server's and nodes' clients
        super().__init__(EtcdRegistry(self.meta, default_ttl_s=TTL, clock=clock.now), clock)
        self.memberships = {}

    async def _seen(self, membership) -> None:
        """Until the registry applied the last put of the membership's key."""
        kv = await self.nodes.client.get(membership.key.encode())
        await wait_until(lambda: (self.registry.revision or 0) >= kv.mod_revision, 2.0, "put seen")

    async def join(self, node: common_pb2.NodeInfo) -> None:
        membership = self.nodes.membership()
        await membership.start(node.role, node.node_id, node.SerializeToString(), ttl_s=TTL)
        self.memberships[node.node_id], self.live[node.node_id] = membership, node
        await self._seen(membership)

    async def report(self, node: common_pb2.NodeInfo) -> None:
        membership = self.memberships[node.node_id]
        self.live[node.node_id] = node
        await wait_until_true(lambda: membership.update(node.SerializeToString()), 5.0, "update written")
        await self._seen(membership)

    async def crash(self, node_id: str) -> None:
        """Stops refreshing its lease (kill -9); until etcd expired it and the registry saw it."""
        del self.live[node_id]
        await self.memberships.pop(node_id).abandon()
        await wait_until(lambda: self.registry.get(node_id).state == DOWN, TTL + 2.0, "crashed node down")

    async def leave(self, node_id: str) -> None:
        del self.live[node_id]
        await self.memberships.pop(node_id).close()
        await wait_until(lambda: self.registry.get(node_id).state == DOWN, 1.0, "left node down")

    async def close(self) -> None:
        for membership in self.memberships.values():
            await membership.close()
        await self.registry.close()
        await self.meta.close()
        await self.nodes.close()


async def wait_until_true(call, timeout_s: float, what: str) -> None:
    """Await call() until it returns True."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await call():
        assert asyncio.get_running_loop().time() < deadline, f"not within {timeout_s}s: {what}"
        await asyncio.sleep(0.05)


@pytest.fixture(scope="module")
def etcd_module(tmp_path_factory):
    pytest.importorskip("aetcd")
    with EtcdServer(tmp_path_factory.mktemp("etcd")) as server:
        yield server


@pytest.fixture(params=["embedded", "etcd"])
def contract(request, run):
    """contract(scenario): runs `await scenario(nodes, registry, clock)` on fresh nodes
    and a fresh registry of this kind (etcd: a cluster name of its own)."""
    server = request.getfixturevalue("etcd_module") if request.param == "etcd" else None

    def go(scenario):
        async def main():
            clock = FakeClock()
            if server is None:
                nodes = EmbeddedNodes(clock)
            else:
                nodes = EtcdNodes(clock, server, f"contract{next(_clusters)}")
            await nodes.registry.start()
            try:
                await scenario(nodes, nodes.registry, clock)
            finally:
                await nodes.close()
        run(main)
    return go


def states(registry) -> list[tuple[str, str]]:
    return [(m.node_id, m.state) for m in registry.members()]


def test_joined_nodes_are_up_with_their_info_in_join_order(contract):
    async def scenario(nodes, registry, clock):
        p0, d0, d1 = info("p0", "prefill"), info("d0", "decode", running=1), info("d1", "decode")
        for node in (p0, d0, d1):
            await nodes.join(node)
        assert [(m.node_id, m.role, m.state) for m in registry.members()] == [
            ("p0", "prefill", UP), ("d0", "decode", UP), ("d1", "decode", UP)]
        assert [m.info for m in registry.alive()] == [p0, d0, d1]
        assert registry.get("d0").info.load.running == 1 and registry.get("x") is None
        assert registry.seconds_since_heartbeat(registry.get("d0")) == 0.0
        assert nodes.joined == ["p0", "d0", "d1"]
    contract(scenario)


def test_a_report_replaces_the_load_and_restarts_the_routed_count(contract):
    async def scenario(nodes, registry, clock):
        await nodes.join(info("d0", "decode"))
        member = registry.get("d0")
        member.routed_since_heartbeat = 3
        clock.t += 0.5
        assert registry.seconds_since_heartbeat(member) == 0.5
        await nodes.report(info("d0", "decode", running=2, waiting=1))
        load = registry.get("d0").info.load
        assert (load.running, load.waiting, member.routed_since_heartbeat) == (2, 1, 0)
        assert registry.seconds_since_heartbeat(member) == 0.0
        clock.t += 0.5
        await nodes.report(info("d0", "decode", running=2, waiting=1))   # nothing changed: still a report
        assert registry.seconds_since_heartbeat(member) == 0.0
        assert registry.get("d0") is member and member.state == UP and nodes.joined == ["d0"]
    contract(scenario)


def test_a_silent_node_is_down_then_forgotten_after_the_retention(contract):
    async def scenario(nodes, registry, clock):
        await nodes.join(info("p0", "prefill"))
        await nodes.join(info("d0", "decode"))
        await nodes.crash("d0")
        assert states(registry) == [("p0", UP), ("d0", DOWN)]
        assert [m.node_id for m in registry.alive()] == ["p0"]
        await nodes.pass_time(10 * TTL)               # down_retention_ttls = 10: still listed
        assert states(registry) == [("p0", UP), ("d0", DOWN)]
        await nodes.pass_time(STEP)
        assert states(registry) == [("p0", UP)] and registry.get("d0") is None
        assert nodes.joined == ["p0", "d0"]
    contract(scenario)


def test_a_node_that_comes_back_joins_again(contract):
    async def scenario(nodes, registry, clock):
        await nodes.join(info("d0", "decode"))
        await nodes.crash("d0")
        assert states(registry) == [("d0", DOWN)]
        await nodes.join(info("d0", "decode", waiting=2))          # restarted
        assert states(registry) == [("d0", UP)] and registry.get("d0").info.load.waiting == 2
        assert nodes.joined == ["d0", "d0"]
    contract(scenario)


def test_remove_forgets_a_node_until_it_reports_again(contract):
    async def scenario(nodes, registry, clock):
        await nodes.join(info("p0", "prefill"))
        await nodes.join(info("d0", "decode"))
        assert registry.remove("d0") is True and registry.remove("ghost") is False
        assert states(registry) == [("p0", UP)] and registry.get("d0") is None
        await nodes.report(info("d0", "decode", running=1))         # it is alive: back as a new member
        assert states(registry) == [("p0", UP), ("d0", UP)] and registry.get("d0").info.load.running == 1
        assert nodes.joined == ["p0", "d0", "d0"]
        await nodes.crash("d0")
        assert registry.remove("d0") is True                        # a down member too
        assert states(registry) == [("p0", UP)]
    contract(scenario)


def test_a_clean_leave(contract):
    """Embedded: Deregister forgets the node at once. etcd: a revoked lease and an
    expired one look the same (the key is deleted), so the node is down, still listed."""
    async def scenario(nodes, registry, clock):
        await nodes.join(info("p0", "prefill"))
        await nodes.join(info("d0", "decode"))
        await nodes.leave("d0")
        after = {"embedded": [("p0", UP)], "etcd": [("p0", UP), ("d0", DOWN)]}
        assert states(registry) == after[nodes.kind]
        assert [m.node_id for m in registry.alive()] == ["p0"]
    contract(scenario)


def test_embedded_registry_grants_its_own_ttl():
    registry = EmbeddedRegistry(default_ttl_s=3.0)
    assert registry.register(info("d0", "decode")) == 3.0
    assert registry.register(info("d1", "decode"), "instance-b") == 3.0
    assert [m.ttl_s for m in registry.members()] == [3.0, 3.0]
    assert registry.heartbeat("ghost", common_pb2.NodeLoad()) is False
    assert registry.deregister("d0") is True and registry.deregister("d0") is False


def test_a_live_node_id_is_refused_to_another_instance_until_its_lease_lapses():
    clock = FakeClock()
    registry = EmbeddedRegistry(default_ttl_s=3.0, clock=clock.now)
    registry.register(info("d0", "decode"), "real")
    with pytest.raises(RegistrationConflictError):
        registry.register(info("d0", "decode"), "impostor")
    with pytest.raises(RegistrationConflictError):
        registry.deregister("d0", "impostor")
    assert registry.heartbeat("d0", common_pb2.NodeLoad(running=9), "impostor") is False
    assert registry.get("d0").instance_id == "real" and registry.get("d0").info.load.running == 0
    assert registry.heartbeat("d0", common_pb2.NodeLoad(), "real") is True
    assert registry.register(info("d0", "decode"), "real") == 3.0     # the same process may join again
    clock.t += 3.1                                                   # the real one stopped reporting
    assert registry.register(info("d0", "decode"), "restarted") == 3.0
    assert registry.get("d0").instance_id == "restarted"


def test_etcd_registry_refuses_rpc_registration():
    pytest.importorskip("aetcd")
    from common.cluster.etcd import EtcdCluster, EtcdConfig
    registry = EtcdRegistry(EtcdCluster(EtcdConfig(endpoint="127.0.0.1:1", cluster="prod")))
    for call, args in ((registry.register, (info("d0", "decode"),)),
                       (registry.heartbeat, ("d0", common_pb2.NodeLoad())), (registry.deregister, ("d0",))):
        with pytest.raises(RegistrationRefusedError, match=r"cluster 'prod' register in etcd at 127\.0\.0\.1:1"):
            call(*args)
    assert registry.members() == []


def test_etcd_registry_serves_the_last_view_while_etcd_is_down(etcd_server, run):
    async def scenario():
        clock = FakeClock()
        nodes = EtcdNodes(clock, etcd_server, "outage")
        await nodes.registry.start()
        try:
            await nodes.join(info("p0", "prefill"))
            await nodes.join(info("d0", "decode"))
            etcd_server.stop()
            for _ in range(10):                       # 2.5 TTLs: any lease would have expired
                await asyncio.sleep(TTL / 4)
                assert states(nodes.registry) == [("p0", UP), ("d0", UP)]
            etcd_server.start()
            await nodes.report(info("d0", "decode", running=4))      # the watch resumed
            assert nodes.registry.get("d0").info.load.running == 4
            await nodes.join(info("d9", "decode"))
            assert states(nodes.registry) == [("p0", UP), ("d0", UP), ("d9", UP)]
            assert nodes.joined == ["p0", "d0", "d9"]
        finally:
            await nodes.close()
    run(scenario)


def test_a_live_node_s_transfer_endpoint_and_kv_cache_cannot_be_claimed_by_another_node_id():
    registry = EmbeddedRegistry(default_ttl_s=3.0)
    real = info("decode-0", "decode")
    real.transfer_endpoint, real.kv_layout.base_address = "127.0.0.1:16000", 0x7F0000000000
    registry.register(real, "real")
    squatter = common_pb2.NodeInfo()
    squatter.CopyFrom(real)
    squatter.node_id = "gateway"
    with pytest.raises(RegistrationConflictError, match="another live node"):
        registry.register(squatter, "other")
    assert [m.node_id for m in registry.members()] == ["decode-0"]
