"""Meta-server process: membership + routing over gRPC.

    server, port = await create_server(meta_cfg)   # bound, started
    ...
    await server.stop(grace)
"""
from __future__ import annotations

import asyncio
import logging

from common.config import MetaConfig
from protos.pdmesh.v1 import meta_pb2, meta_pb2_grpc
from services import grpc_util
from services.meta_server.registry import EmbeddedRegistry
from services.meta_server.router import Router
from services.meta_server.servicer import MetaServicer

log = logging.getLogger("pdmesh.meta")
SERVICE_NAME = meta_pb2.DESCRIPTOR.services_by_name["MetaServer"].full_name


async def create_server(cfg: MetaConfig, port: int | None = None):
    server = grpc_util.new_server()
    registry = EmbeddedRegistry(default_ttl_s=cfg.ttl_seconds)
    router = Router(cfg.policy, cfg.local_prefill_max_tokens)
    servicer = MetaServicer(registry, router)
    meta_pb2_grpc.add_MetaServerServicer_to_server(servicer, server)
    health = grpc_util.add_health_and_reflection(server, [SERVICE_NAME])
    bound = grpc_util.bind(server, cfg.host, cfg.port if port is None else port)
    await server.start()
    await grpc_util.mark_serving(health, [SERVICE_NAME])
    server.servicer = servicer
    log.info("meta-server serving at %s:%d (policy %s, ttl %.1fs)", cfg.host, bound, cfg.policy,
             cfg.ttl_seconds)
    return server, bound


async def serve(cfg: MetaConfig) -> None:
    server, _ = await create_server(cfg)
    await server.wait_for_termination()


def main(cfg: MetaConfig) -> None:
    asyncio.run(serve(cfg))
