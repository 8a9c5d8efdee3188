"""Shared start-up of engine nodes (prefill, decode, both): load the engine, bind, serve
the role's servicer plus health and reflection, join the mesh, then watch the engine
(services/node/node_health.py: `server.health.failed` is set when it died)."""
from __future__ import annotations

import logging

from common.config import MeshConfig, NodeConfig
from common.metrics import close_metrics, serve_metrics
from protos.pdmesh.v1 import engine_pb2, engine_pb2_grpc, weights_pb2, weights_pb2_grpc
from services.node import grpc_util
from services.node.engine_node import EngineNode
from services.node.fault_injection import install_fault_injection
from services.node.node_health import NodeHealth

log = logging.getLogger("pdmesh.node")
SERVICES = engine_pb2.DESCRIPTOR.services_by_name


async def create_node_server(mesh: MeshConfig, node_cfg: NodeConfig, port: int | None = None,
                             credentials=None):
    """Returns (server, port); server.node is the EngineNode; stop with stop_node_server.
    credentials: a MeshCredentials (default: what mesh.security and the environment give
    for node_cfg.node_id)."""
    from services.decode.servicer import DecodeServicer
    from services.prefill.servicer import PrefillServicer

    if credentials is None:
        from services.security.credentials import install_default, load_credentials
        credentials = load_credentials(mesh.security, node_cfg.node_id)
        install_default(credentials)
    server = grpc_util.new_server(credentials)   # before the engine loads: no identity, no start
    node = await EngineNode.create(mesh, node_cfg)
    if node_cfg.role == "prefill":
        server.servicer = PrefillServicer(node)
        engine_pb2_grpc.add_PrefillServicer_to_server(server.servicer, server)
        names = [SERVICES["Prefill"].full_name]
    else:
        server.servicer = DecodeServicer(node)
        engine_pb2_grpc.add_DecodeServicer_to_server(server.servicer, server)
        names = [SERVICES["Decode"].full_name]
    if node.weight_seed is not None:
        weights_pb2_grpc.add_WeightSeedServicer_to_server(node.weight_seed, server)
        names.append(weights_pb2.DESCRIPTOR.services_by_name["WeightSeed"].full_name)
    health = grpc_util.add_health_and_reflection(server, names)
    bound = grpc_util.bind(server, node_cfg.host, node_cfg.port if port is None else port)
    await server.start()
    # before joining: a taken metrics port fails the start with the node still out of the mesh
    try:
        server.metrics_server = await serve_metrics(node.metrics.registry, node_cfg.host, node_cfg.metrics_port,
                                                    node_cfg.node_id)   # None when metrics_port is 0
    except BaseException:   # the node too: its step thread, ranks and transfer engine
        await server.stop(None)
        await node.close()
        raise
    node.start(f"{node_cfg.advertised_host}:{bound}")
    await grpc_util.mark_serving(health, names)
    server.node = node
    server.health = NodeHealth(node, health, names)
    server.health.start()
    install_fault_injection(node)
    log.info("%s node %s serving at %s:%d (transfer %s at %s)", node_cfg.role, node_cfg.node_id,
             node_cfg.host, bound, node.transfer.name, node.transfer.endpoint)
    return server, bound


async def stop_node_server(server, grace: float = 1.0) -> None:
    """A prefill node first drains its KV writes (see PrefillServicer.drain): a decode
    node frees quarantined blocks once this port refuses connections."""
    await close_metrics(server)
    await server.health.close()
    drain = getattr(server.servicer, "drain", None)
    if drain is not None:
        await drain(server.node.mesh.timeouts.transfer_bound_s)
    await server.stop(grace)
    await server.node.close()
