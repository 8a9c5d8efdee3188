"""A Mixture-of-Experts node's expert counts reach the meta-server beside its membership,
never inside its NodeInfo (services/node/node_registration.py, services/meta_server/
registry): a heartbeat carries them only when they changed since the last one answered
(and in the first after each Register); Route and ListMembers hand out a NodeInfo without
them while the dashboard document shows them; the same over etcd, where they live under a
key of their own that never makes a member."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from common.config import MeshConfig, MetaConfig
from protos.pdmesh.v1 import common_pb2, meta_pb2, meta_pb2_grpc
from services.meta_server.dashboard.cluster_view import ClusterView
from services.meta_server.registry import DOWN
from services.meta_server.server import create_server
from services.node.node_registration import EXPERT_TOKENS_ROLE, RpcRegistration, create_registration
from tests.channels import operator_channel
from tests.etcd_server import etcd_server, loop, run, wait_until  # noqa: F401  (fixtures)

TTL = 1.0
REPORT_S = TTL / 3 + 0.5          # one report period, with room for a loaded machine
NUM_LAYERS, NUM_EXPERTS = 58, 256  # DeepSeek-V3's MoE layers: what must stay out of every NodeInfo
pytestmark = pytest.mark.timeout(60)


def big_counts(base: int) -> dict[int, list[int]]:
    return {3 + i: [base + i * NUM_EXPERTS + e for e in range(NUM_EXPERTS)] for i in range(NUM_LAYERS)}


class Node:
    """A node's NodeInfo and expert counts, both changed by the test."""

    def __init__(self, counts: dict[int, list[int]]):
        self.counts = counts
        self.running = 0

    def info(self) -> common_pb2.NodeInfo:
        return common_pb2.NodeInfo(node_id="d0", role="decode", address="127.0.0.1:9", model_id="m",
                                   load=common_pb2.NodeLoad(running=self.running, free_blocks=8, total_blocks=8))

    def expert_tokens(self) -> dict[int, list[int]]:
        return {layer: list(row) for layer, row in self.counts.items()}   # fresh, as the engine's


def test_node_load_has_no_expert_counts_and_its_field_number_is_reserved():
    assert "expert_load" not in common_pb2.NodeLoad.DESCRIPTOR.fields_by_name
    assert 9 not in common_pb2.NodeLoad.DESCRIPTOR.fields_by_number
    assert not hasattr(common_pb2, "ExpertLoad")        # the name is the engine's drain manager's


class FakeMeta:
    """MetaServer stub: records every request; `fail` is raised by the next Heartbeat."""

    def __init__(self):
        self.calls: list = []
        self.fail: grpc.StatusCode | None = None

    async def Register(self, request, timeout):
        self.calls.append(request)
        return meta_pb2.RegisterResponse(ttl_seconds=TTL)

    async def Heartbeat(self, request, timeout):
        self.calls.append(request)
        code, self.fail = self.fail, None
        if code is not None:
            raise grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="test")
        return meta_pb2.HeartbeatResponse()


def sent(request) -> dict[int, list[int]] | None:
    """The counts a request carried (None: none), and that it is a heartbeat."""
    assert isinstance(request, meta_pb2.HeartbeatRequest), request
    if not request.HasField("expert_tokens"):
        return None
    return {e.layer: list(e.num_tokens) for e in request.expert_tokens.layers}


def test_heartbeats_carry_the_counts_only_when_they_changed():
    async def scenario():
        node = Node({0: [1, 2], 1: [0, 0]})
        registration = RpcRegistration("127.0.0.1:1", node.info, TTL, node.expert_tokens)
        meta = registration._stub = FakeMeta()
        try:
            steps = []
            for change in (None, None, None, {0: [1, 3]}, None, "fail", None, None, "lost", None, None):
                if isinstance(change, dict):
                    node.counts.update(change)
                elif change == "fail":
                    node.counts[1] = [4, 4]
                    meta.fail = grpc.StatusCode.UNAVAILABLE
                elif change == "lost":
                    meta.fail = grpc.StatusCode.NOT_FOUND
                before = len(meta.calls)
                await registration._report()
                steps.append([sent(c) if isinstance(c, meta_pb2.HeartbeatRequest) else "register"
                              for c in meta.calls[before:]])
        finally:
            await registration._channel.close()
        assert steps == [
            ["register"],
            [{0: [1, 2], 1: [0, 0]}],          # the first heartbeat: every count
            [None],                            # nothing changed: no counts
            [{0: [1, 3], 1: [0, 0]}],          # changed: all of them again
            [None],
            [{0: [1, 3], 1: [4, 4]}],          # sent, but not answered ...
            ["register"],
            [{0: [1, 3], 1: [4, 4]}],          # ... so sent again after registering
            [None, "register"],                # the meta-server forgot the node (NOT_FOUND)
            [{0: [1, 3], 1: [4, 4]}],          # a new join starts without counts: sent again
            [None],
        ]

    asyncio.run(scenario())


def test_a_dense_node_never_sends_counts():
    async def scenario():
        node = Node({})
        registration = RpcRegistration("127.0.0.1:1", node.info, TTL, node.expert_tokens)
        meta = registration._stub = FakeMeta()
        try:
            for _ in range(3):
                await registration._report()
        finally:
            await registration._channel.close()
        assert [sent(c) for c in meta.calls[1:]] == [None, None]

    asyncio.run(scenario())


@pytest.mark.parametrize("kind", ["embedded", "etcd"])
def test_route_and_members_hand_out_no_expert_counts_while_the_dashboard_shows_them(kind, request, run):
    etcd = None
    if kind == "etcd":
        pytest.importorskip("aetcd")
        from common.cluster.etcd import EtcdConfig
        etcd = EtcdConfig(endpoint=request.getfixturevalue("etcd_server").endpoint, cluster="experts")

    async def scenario():
        server, port = await create_server(MetaConfig(port=0, ttl_seconds=TTL), etcd=etcd)
        registry = server.control.registry
        view = ClusterView(server.control)
        mesh = MeshConfig(model="unused", meta=MetaConfig(port=port, ttl_seconds=TTL), cluster="experts",
                          etcd_endpoint=etcd.endpoint if etcd else "")
        node = Node(big_counts(0))
        registration = create_registration(mesh, node.info, node.expert_tokens)

        async def experts() -> dict | None:
            nodes = (await view.snapshot())["nodes"]
            return nodes[0].get("experts") if nodes else None

        def doc_of(counts):
            return {"layers": list(counts), "num_tokens": list(counts.values())}

        try:
            registration.start()
            start = asyncio.get_running_loop().time()
            while await experts() != doc_of(node.counts):
                assert asyncio.get_running_loop().time() - start < 2.0 + REPORT_S, await experts()
                await asyncio.sleep(0.02)
            assert [m.node_id for m in registry.members()] == ["d0"]     # the counts' key is no member
            async with operator_channel(f"127.0.0.1:{port}") as ch:
                stub = meta_pb2_grpc.MetaServerStub(ch)
                route = await stub.Route(meta_pb2.RouteRequest(request_id="r1", model_id="m"))
                members = await stub.ListMembers(meta_pb2.ListMembersRequest())
            # exactly the node's NodeInfo, byte for byte: not a count in it
            assert route.decode.SerializeToString() == node.info().SerializeToString()
            assert [m.SerializeToString() for m in members.nodes] == [node.info().SerializeToString()]
            assert route.ByteSize() < 200 and members.ByteSize() < 200
            node.counts = big_counts(7)
            start = asyncio.get_running_loop().time()
            while await experts() != doc_of(node.counts):
                assert asyncio.get_running_loop().time() - start < REPORT_S, "the changed counts"
                await asyncio.sleep(0.02)
            await registration.close()
            after = {"embedded": None, "etcd": DOWN}[kind]      # Deregister forgets; a revoked lease is down
            await wait_until(lambda: getattr(registry.get("d0"), "state", None) == after, 1.0, "left")
            await wait_until(lambda: registry.expert_tokens("d0") == {}, 1.0, "the counts dropped")
        finally:
            await registration.close()
            await view.close()
            await server.stop(0)
            await server.close_extras()
    run(scenario)


def test_the_etcd_counts_key_is_the_nodes_own(etcd_server, run):
    """A value that does not parse is ignored (logged); its deletion alone never marks a
    member down."""
    pytest.importorskip("aetcd")
    from common.cluster.etcd import EtcdCluster, EtcdConfig

    async def scenario():
        cfg = EtcdConfig(endpoint=etcd_server.endpoint, cluster="expertkey")
        server, _ = await create_server(MetaConfig(port=0, ttl_seconds=TTL), etcd=cfg)
        registry = server.control.registry
        async with EtcdCluster(cfg) as cluster:
            node, counts = cluster.membership(), cluster.membership()
            await node.start("decode", "d0", Node({}).info().SerializeToString(), ttl_s=TTL)
            await counts.start(EXPERT_TOKENS_ROLE, "d0", b"\xff\xff", ttl_s=TTL)
            await wait_until(lambda: registry.get("d0") is not None, 2.0, "joined")
            await asyncio.sleep(0.2)
            assert registry.expert_tokens("d0") == {}
            good = common_pb2.ExpertTokens(layers=[common_pb2.LayerExpertTokens(layer=1, num_tokens=[5, 6])])
            await counts.update(good.SerializeToString())
            await wait_until(lambda: registry.expert_tokens("d0") == {1: [5, 6]}, 2.0, "counts")
            await counts.close()
            await wait_until(lambda: registry.expert_tokens("d0") == {}, 2.0, "counts gone")
            assert registry.get("d0").state != DOWN and [m.node_id for m in registry.members()] == ["d0"]
            await node.close()
        await server.stop(0)
        await server.close_extras()
    run(scenario)
