"""kv-store process: the KVStore gRPC service over a pool registered with the mesh's
transfer engine, the optional Redis tier, and a task expiring stale puts and pins.

    server, port = await create_server(mesh)   # mesh.kv_store must be set
    ...
    await stop_server(server, grace)
"""
from __future__ import annotations

import asyncio
import logging

from common.config import MeshConfig
from common.metrics import close_metrics, serve_metrics
from common.transfer.factory import create_transfer
from protos.pdmesh.v1 import kv_store_pb2, kv_store_pb2_grpc
from services.node import grpc_util
from services.node.engine_node import transfer_options
from services.kv_store.metrics import kv_store_registry
from services.kv_store.redis_tier import RedisTier
from services.kv_store.servicer import KVStoreServicer
from services.kv_store.store import KVStore
from services.node.members_view import MembersView

log = logging.getLogger("pdmesh.kv_store")
SERVICE_NAME = kv_store_pb2.DESCRIPTOR.services_by_name["KVStore"].full_name


async def _expire_loop(store: KVStore, period_s: float) -> None:
    while True:
        await asyncio.sleep(period_s)
        store.expire()


async def create_server(mesh: MeshConfig, port: int | None = None, credentials=None):
    """Returns (server, port); server.store is the KVStore. credentials: a MeshCredentials
    (default: what mesh.security and the environment give)."""
    cfg = mesh.kv_store
    if cfg is None:
        raise ValueError("the mesh config has no kv_store section")
    transfer = create_transfer(mesh.transfer.backend,
                               **transfer_options(mesh, cfg.advertise_host or cfg.host))
    redis = None
    if cfg.redis_url:
        redis = RedisTier(cfg.redis_url, key_prefix=f"pdmesh:{mesh.cluster}:kv", ttl_s=cfg.redis_ttl_s)
    if credentials is None:
        from services.security.credentials import install_default, load_credentials
        credentials = load_credentials(mesh.security, "kv-store")
        install_default(credentials)
    # key spaces only for models that live members serve (their list from the meta-server)
    store = KVStore(cfg, transfer, redis, timeouts=mesh.timeouts, members=MembersView.for_mesh(mesh, credentials))
    server = grpc_util.new_server(credentials)
    kv_store_pb2_grpc.add_KVStoreServicer_to_server(KVStoreServicer(store), server)
    health = grpc_util.add_health_and_reflection(server, [SERVICE_NAME])
    bound = grpc_util.bind(server, cfg.host, cfg.port if port is None else port)
    await server.start()
    await grpc_util.mark_serving(health, [SERVICE_NAME])
    t = mesh.timeouts
    period = min(t.kv_store_pin_lease_s, t.kv_store_reserve_lease_s, 2.0) / 4
    server.store = store
    server.expiry = asyncio.get_running_loop().create_task(_expire_loop(store, period))
    async with grpc_util.stopped_on_error(server):
        server.metrics_server = await serve_metrics(kv_store_registry(store), cfg.host, cfg.metrics_port,
                                                    "kv-store")   # None when metrics_port is 0
    log.info("kv-store serving at %s:%d (transfer %s at %s; %.0f MB per key space; Redis %s)",
             cfg.host, bound, transfer.name, transfer.endpoint, cfg.capacity_mb,
             cfg.redis_url or "off")
    return server, bound


async def stop_server(server, grace: float = 1.0) -> None:
    server.expiry.cancel()
    await close_metrics(server)
    await server.stop(grace)
    await server.store.close()
    server.store.transfer.close()
