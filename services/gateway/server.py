"""Gateway process: the public API in front of the mesh."""
from __future__ import annotations

import logging

from common.config import MeshConfig
from common.model.config import load_model_config
from common.model.tokenizer import Tokenizer
from protos.pdmesh.v1 import gateway_pb2
from services.node import grpc_util
from services.gateway.servicer import GatewayServicer
from services.gateway.wire import add_gateway_to_server

log = logging.getLogger("pdmesh.gateway")
SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name


def max_model_len(mesh: MeshConfig, max_position_embeddings: int) -> int:
    configured = int(mesh.engine.get("max_model_len", 0) or 0)
    return min(configured, max_position_embeddings) if configured else max_position_embeddings


async def create_server(mesh: MeshConfig, port: int | None = None, credentials=None):
    """Returns (server, port). credentials: a MeshCredentials (default: what mesh.security,
    gateway.api_keys_file and the environment give); with API keys, clients must send one."""
    mcfg = load_model_config(mesh.model)
    servicer = GatewayServicer(Tokenizer.from_dir(mesh.model), mesh.resolved_model_id,
                               mcfg.vocab_size, max_model_len(mesh, mcfg.max_position_embeddings),
                               list(mesh.gateway.meta_addresses) or [mesh.meta.address],
                               mesh.timeouts, mesh.gateway.max_migrations, limits=mesh.limits)
    if credentials is None:
        from services.security.credentials import install_default, load_credentials
        credentials = load_credentials(mesh.security, "gateway", mesh.gateway.api_keys_file)
        install_default(credentials)
    if not credentials.api_keys:
        log.warning("gateway: no API keys configured (gateway.api_keys_file): the public API is open "
                    "to anyone who reaches its port")
    server = grpc_util.new_server(credentials, public=True)
    add_gateway_to_server(servicer, server)   # parses requests itself: bad bytes -> INVALID_ARGUMENT
    health = grpc_util.add_health_and_reflection(server, [SERVICE_NAME])
    bound = grpc_util.bind(server, mesh.gateway.host, mesh.gateway.port if port is None else port)
    await server.start()
    await grpc_util.mark_serving(health, [SERVICE_NAME])
    server.servicer = servicer
    log.info("gateway serving at %s:%d for model %s", mesh.gateway.host, bound, mesh.resolved_model_id)
    return server, bound
