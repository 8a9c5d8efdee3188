"""Gateway process: the public API in front of the mesh."""
from __future__ import annotations

import logging

from common.config import MeshConfig
from common.metrics import serve_metrics
from common.model.config import load_model_config
from common.model.tokenizer import Tokenizer
from protos.pdmesh.v1 import gateway_pb2
from services.node import grpc_util
from services.gateway.load_report import report_every_s
from services.gateway.servicer import GatewayServicer
from services.gateway.wire import add_gateway_to_server

log = logging.getLogger("pdmesh.gateway")
SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name


def max_model_len(mesh: MeshConfig, max_position_embeddings: int) -> int:
    configured = int(mesh.engine.get("max_model_len", 0) or 0)
    return min(configured, max_position_embeddings) if configured else max_position_embeddings


async def create_server(mesh: MeshConfig, port: int | None = None, credentials=None):
    """Returns (server, port). credentials: a MeshCredentials (default: what mesh.security,
    gateway.api_keys_file and the environment give); with API keys, clients must send one.
    With gateway.http_port, server.http is the OpenAI-compatible HTTP API on this event
    loop (else None): stop it with stop_http(server, grace) before server.stop(grace)."""
    mcfg = load_model_config(mesh.model)
    servicer = GatewayServicer(Tokenizer.from_dir(mesh.model), mesh.resolved_model_id,
                               mcfg.vocab_size, max_model_len(mesh, mcfg.max_position_embeddings),
                               list(mesh.gateway.meta_addresses) or [mesh.meta.address],
                               mesh.timeouts, mesh.gateway.max_migrations, limits=mesh.limits,
                               membership_ttl_s=mesh.meta.ttl_seconds,
                               report_every_s=report_every_s(mesh.meta.planner.interval_s)
                               if mesh.meta.planner.enabled else 0.0)
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
    server.servicer = servicer
    # the OpenAI HTTP API (gateway.http_port; None when 0), up before health says SERVING
    try:
        server.http = await _start_http(mesh, servicer, credentials)
    except BaseException:
        await server.stop(None)
        await servicer.close()
        raise
    await grpc_util.mark_serving(health, [SERVICE_NAME])
    # GET /metrics (gateway.metrics_port; None when 0); close with common.metrics.close_metrics(server)
    try:
        server.metrics_server = await serve_metrics(servicer.metrics.registry, mesh.gateway.host,
                                                    mesh.gateway.metrics_port, "gateway")
    except BaseException:
        await stop_http(server, None)
        await server.stop(None)
        await servicer.close()
        raise
    log.info("gateway serving at %s:%d for model %s", mesh.gateway.host, bound, mesh.resolved_model_id)
    return server, bound


async def _start_http(mesh: MeshConfig, servicer: GatewayServicer, credentials):
    """The OpenAI-compatible HTTP API on gateway.host:gateway.http_port, on this event
    loop (services/gateway/openai_http); None when http_port is 0."""
    if not mesh.gateway.http_port:
        return None
    from services.gateway.openai_http.app import create_app
    from services.gateway.openai_http.chat_template import ChatTemplate
    from services.gateway.openai_http.server import HttpServer
    try:
        template = ChatTemplate.from_dir(mesh.model)
    except ValueError as e:   # TemplateError: the model's template does not parse
        log.warning("gateway: %s", e)
        template = None
    if template is None:
        log.warning("gateway: no usable chat template in the model: /v1/chat/completions answers 400")
    http = HttpServer(create_app(servicer, credentials, template), mesh.gateway.host, mesh.gateway.http_port,
                      tls=credentials.tls)
    await http.start()
    log.info("gateway: OpenAI-compatible HTTP API at %s/v1", http.url)
    return http


async def stop_http(server, grace: float | None = 1.0) -> None:
    """Stop the gateway's HTTP API, if it has one; before server.stop(grace), so that its
    streams are cancelled while the decode channels are still open."""
    http = getattr(server, "http", None)
    if http is not None:
        await http.stop(grace)
