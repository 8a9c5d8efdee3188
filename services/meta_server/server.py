"""Meta-server process: membership + routing (pdmesh.v1.MetaServer) and the operator API
(pdmesh.v1.MetaAdmin) over gRPC, with health and reflection listing both.

    server, port = await create_server(meta_cfg)   # bound, started
    server.control                                  # the MetaControl behind both services
    ...
    await server.stop(grace)

Membership: a Registry from create_registry (embedded, or etcd when `etcd` is given).
admin_state: where drained nodes and the policy live; default in memory seeded with
cfg.policy, or in etcd (StoreAdminState) when `etcd` is given, or the caller's; its
load() is awaited before serving, so a restarted meta-server routes as before (a stored
policy wins over cfg.policy).

Planner (cfg.planner.enabled): its profile is loaded before anything binds (ProfileError,
a ValueError naming the file, otherwise); then control.planner is a PlannerLoop deciding
every cfg.planner.interval_s (services/meta_server/planner_loop.py), else None.
"""
from __future__ import annotations

import asyncio
import logging

from common.cluster.base import ETCD_EXPIRY_CHECK_S, Backoff, election_ttl_seconds
from common.config import MetaConfig
from common.metrics import serve_metrics
from protos.pdmesh.v1 import meta_pb2, meta_pb2_grpc
from services.node import grpc_util
from services.meta_server.admin_servicer import MetaAdminServicer
from services.meta_server.admin_state import (AdminState, AdminStateUnavailableError, InMemoryAdminState,
                                              StoreAdminState)
from services.meta_server.control import MetaControl
from services.meta_server.metrics import meta_registry
from services.meta_server.planner_loop import PlannerLoop
from services.meta_server.profile_file import load_profile
from services.meta_server.registry import create_registry
from services.meta_server.store_hits import StoreHits
from services.meta_server.router import Router
from services.meta_server.servicer import MetaServicer

log = logging.getLogger("pdmesh.meta")
SERVICES = meta_pb2.DESCRIPTOR.services_by_name
SERVICE_NAMES = [SERVICES["MetaServer"].full_name, SERVICES["MetaAdmin"].full_name]


async def create_server(cfg: MetaConfig, port: int | None = None,
                        admin_state: AdminState | None = None, etcd=None, kv_store_address: str = "",
                        kv_store_lookup_s: float = 0.05, credentials=None):
    """etcd: an EtcdConfig (the mesh has an etcd_endpoint). Then the node table is an
    EtcdRegistry, the admin state lives in etcd and the meta-servers sharing it elect a
    leader; else the embedded registry, in-memory admin state and no election.
    kv_store_address: the kv-store whose hits cache_aware routing counts (each Lookup
    bounded by kv_store_lookup_s, timeouts.kv_store_lookup_s). Call
    `await server.close_extras()` after stopping. credentials: a MeshCredentials (default
    the process's: services/security/credentials.py). PlaintextBindError before anything
    starts when the dashboard (plain HTTP, the admin token on the wire) would bind a
    non-loopback host without security.allow_plaintext."""
    profile = load_profile(cfg.planner.profile) if cfg.planner.enabled else None   # before anything starts
    if cfg.dashboard_port:
        from services.security.bind_policy import check_bind
        from services.security.credentials import process_credentials
        check_bind(cfg.host, cfg.dashboard_port, False, (credentials or process_credentials()).allow_plaintext,
                   "meta-server dashboard", http_only=True)
    cluster = None
    if etcd is not None:
        from common.cluster.etcd import EtcdCluster
        cluster = EtcdCluster(etcd)
        admin_state = admin_state or StoreAdminState(cluster.admin_store(), cfg.policy)
    admin = admin_state or InMemoryAdminState(cfg.policy)
    await admin.load()
    control = MetaControl(create_registry(cfg, cluster),
                          Router(cfg.local_prefill_max_tokens, cfg.prefill_queue_threshold), admin)
    await control.registry.start()
    if profile is not None:
        control.planner = PlannerLoop(cfg.planner, profile, control)
    server = grpc_util.new_server(credentials)
    store_hits = StoreHits(kv_store_address, kv_store_lookup_s) if kv_store_address else None
    meta_pb2_grpc.add_MetaServerServicer_to_server(MetaServicer(control, store_hits), server)
    meta_pb2_grpc.add_MetaAdminServicer_to_server(MetaAdminServicer(control), server)
    health = grpc_util.add_health_and_reflection(server, SERVICE_NAMES)
    bound = grpc_util.bind(server, cfg.host, cfg.port if port is None else port)
    await server.start()
    await grpc_util.mark_serving(health, SERVICE_NAMES)
    server.control = control
    async with grpc_util.stopped_on_error(server):
        server.metrics_server = await serve_metrics(meta_registry(control), cfg.host, cfg.metrics_port,
                                                    "meta-server")   # None when metrics_port is 0
    server.dashboard = await _dashboard(cfg, control, kv_store_address, credentials)   # None when off
    if control.planner is not None:
        control.planner.start()
    if cluster is not None:
        control.candidate_id = f"{cfg.advertise_host or cfg.host}:{bound}"
        await campaign(control, cluster, cfg.ttl_seconds)

    async def close_extras() -> None:
        if control.planner is not None:
            await control.planner.close()
        if server.metrics_server is not None:
            await server.metrics_server.close()
        if server.dashboard is not None:
            await server.dashboard.close()
        if control.election is not None:
            await control.election.resign()
        await control.registry.close()
        if cluster is not None:
            await cluster.close()
        if store_hits is not None:
            await store_hits.close()

    server.close_extras = close_extras
    log.info("meta-server serving at %s:%d (policy %s, ttl %.1fs)", cfg.host, bound, admin.policy(),
             cfg.ttl_seconds)
    if control.planner is not None:
        p = cfg.planner
        log.info("planner: every %gs for TTFT <= %g ms, ITL <= %g ms, %d..%d nodes a role (profile %s)",
                 p.interval_s, p.ttft_slo_ms, p.itl_slo_ms, p.min_nodes, p.max_nodes, p.profile)
    return server, bound


async def _dashboard(cfg: MetaConfig, control: MetaControl, kv_store_address: str, credentials):
    """The KV-memory dashboard on cfg.dashboard_port (services/meta_server/dashboard), behind
    the admin token; None when the port is 0 (or taken)."""
    if not cfg.dashboard_port:
        return None
    from services.meta_server.dashboard.cluster_view import ClusterView
    from services.meta_server.dashboard.http import serve_dashboard
    from services.security.credentials import process_credentials
    token = (credentials or process_credentials()).admin_token
    return await serve_dashboard(ClusterView(control, kv_store_address), token, cfg.host, cfg.dashboard_port)


async def campaign(control: MetaControl, cluster, ttl_s: float) -> None:
    """Join the election on a lease of half the membership TTL (a standby then leads
    within one TTL of the leader's death). On becoming leader, reload the admin state
    (what the previous leader stored) before routing, retrying while etcd is away."""
    lease_ttl = election_ttl_seconds(ttl_s)
    if lease_ttl + ETCD_EXPIRY_CHECK_S >= ttl_s:
        log.warning("ttl_seconds %.1f: a standby may need up to %.1fs to take over (use >= 2)",
                    ttl_s, lease_ttl + ETCD_EXPIRY_CHECK_S)

    async def take_over() -> None:
        backoff = Backoff(0.1, 1.0)
        while True:
            try:
                await control.admin.load()
                control.leader_ready = True
                return
            except AdminStateUnavailableError as e:
                delay = backoff.next()
                log.warning("new leader: %s; retrying in %.2fs", e, delay)
                await asyncio.sleep(delay)

    def on_leadership(leading: bool) -> None:
        log.info("meta-server %s is %s", control.candidate_id, "the leader" if leading else "a standby")
        if control.take_over_task is not None:
            control.take_over_task.cancel()
            control.take_over_task = None
        if leading:
            control.leader_ready = False
            control.take_over_task = asyncio.get_running_loop().create_task(take_over())

    control.election = cluster.election(on_change=on_leadership)
    await control.election.campaign(control.candidate_id, ttl_s=lease_ttl)


async def serve(cfg: MetaConfig) -> None:
    server, _ = await create_server(cfg)
    await server.wait_for_termination()


def main(cfg: MetaConfig) -> None:
    asyncio.run(serve(cfg))
