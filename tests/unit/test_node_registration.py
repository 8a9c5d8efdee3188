"""services/node/node_registration.py against a real meta-server (create_server, port 0):
with the embedded registry over gRPC, and with nodes and registry in a real etcd. The
same scenario either way: join, load reports, back after an operator's remove, leave."""
from __future__ import annotations

import grpc
import pytest

from common.config import MeshConfig, MetaConfig
from protos.pdmesh.v1 import common_pb2, meta_pb2, meta_pb2_grpc
from services.meta_server.registry import DOWN, UP
from services.meta_server.server import create_server
from services.node.node_registration import EtcdRegistration, RpcRegistration, create_registration
from tests.etcd_server import etcd_server, loop, run, wait_until  # noqa: F401  (fixtures)
from tests.channels import operator_channel

TTL = 1.0
REPORT_S = TTL / 3 + 0.5          # one report period, with room for a loaded machine
pytestmark = pytest.mark.timeout(60)


class Node:
    """A node's NodeInfo, its load changed by the test."""

    def __init__(self):
        self.running = 0

    def info(self) -> common_pb2.NodeInfo:
        return common_pb2.NodeInfo(node_id="d0", role="decode", address="127.0.0.1:9", model_id="m",
                                   load=common_pb2.NodeLoad(running=self.running, total_blocks=8))


@pytest.mark.parametrize("kind", ["embedded", "etcd"])
def test_a_node_stays_registered_and_reports_its_load(kind, request, run):
    etcd = None
    if kind == "etcd":
        pytest.importorskip("aetcd")
        from common.cluster.etcd import EtcdConfig
        etcd = EtcdConfig(endpoint=request.getfixturevalue("etcd_server").endpoint, cluster="nodereg")

    async def scenario():
        server, port = await create_server(MetaConfig(port=0, ttl_seconds=TTL), etcd=etcd)
        registry = server.control.registry
        mesh = MeshConfig(model="unused", meta=MetaConfig(port=port, ttl_seconds=TTL), cluster="nodereg",
                          etcd_endpoint=etcd.endpoint if etcd else "")
        node = Node()
        registration = create_registration(mesh, node.info)
        assert type(registration) is {"embedded": RpcRegistration, "etcd": EtcdRegistration}[kind]
        try:
            registration.start()
            # the registry may see the key (watch) a moment before the put returns to the node
            await wait_until(lambda: registry.get("d0") is not None and registration.registered, 2.0, "joined")
            assert registry.get("d0").info == node.info()
            node.running = 3
            await wait_until(lambda: registry.get("d0").info.load.running == 3, REPORT_S, "load reported")
            assert registry.remove("d0")
            await wait_until(lambda: registry.get("d0") is not None, REPORT_S, "back after remove")
            assert registry.get("d0").state == UP and registry.get("d0").info == node.info()
            await registration.close()
            after = {"embedded": None, "etcd": DOWN}[kind]      # Deregister forgets; a revoked lease is down
            await wait_until(lambda: getattr(registry.get("d0"), "state", None) == after, 1.0, "left")
            assert not registration.registered
        finally:
            await registration.close()
            await server.stop(0)
            await server.close_extras()
    run(scenario)


def test_meta_server_over_etcd_refuses_rpc_registration(etcd_server, run):
    pytest.importorskip("aetcd")
    from common.cluster.etcd import EtcdConfig

    async def scenario():
        server, port = await create_server(MetaConfig(port=0, ttl_seconds=TTL),
                                           etcd=EtcdConfig(endpoint=etcd_server.endpoint, cluster="refuse"))
        try:
            async with operator_channel(f"127.0.0.1:{port}") as ch:
                stub = meta_pb2_grpc.MetaServerStub(ch)
                for call in (stub.Register(meta_pb2.RegisterRequest(node=Node().info())),
                             stub.Heartbeat(meta_pb2.HeartbeatRequest(node_id="d0")),
                             stub.Deregister(meta_pb2.DeregisterRequest(node_id="d0"))):
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await call
                    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                    assert "register in etcd" in err.value.details()
            assert server.control.registry.members() == []
        finally:
            await server.stop(0)
            await server.close_extras()
    run(scenario)
