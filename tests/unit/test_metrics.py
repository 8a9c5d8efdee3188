"""Prometheus metrics: each service's collectors with exact values, the block manager's
prefix-cached count, the /metrics HTTP server, metrics_port in the config and the
launcher (common/metrics.py, services/*/metrics.py)."""
from __future__ import annotations

import asyncio
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest

from common.config import GatewayConfig, KVStoreConfig, MetaConfig, NodeConfig, mesh_config_from_dict
from common.engine.block_manager import BlockManager
from common.engine.sampling_params import SamplingParams
from common.engine.sequence import Sequence
from common.metrics import MetricsServer, exported_names
from protos.pdmesh.v1 import common_pb2
from services.gateway import metrics as gateway_metrics
from services.gateway.metrics import GatewayMetrics
from services.kv_store.metrics import kv_store_registry
from services.meta_server.admin_state import InMemoryAdminState
from services.meta_server.control import MetaControl
from services.meta_server.metrics import meta_registry
from services.meta_server.registry import EmbeddedRegistry
from services.meta_server.router import RouteRequest, Router
from services.node.grpc_util import free_port
from services.node.metrics import NodeMetrics

SNAPSHOT = {"running": 3, "waiting": 2, "kv_remote": 1, "held": 0, "free_blocks": 40, "used_blocks": 24,
            "total_blocks": 64, "prefix_hit_tokens": 48, "prefix_query_tokens": 200, "preemptions": 1,
            "quarantined_blocks": 4, "cached_blocks": 10, "borrowed_core_steps": 7}


def value(registry, metric: str, **labels) -> float | None:
    return registry.get_sample_value(metric, labels)


# ---- engine nodes ----------------------------------------------------------------------
def test_engine_collector_reads_the_snapshot_at_scrape_time():
    snapshot = dict(SNAPSHOT)
    transfer = SimpleNamespace(bytes_written=4096, bytes_read=512)
    m = NodeMetrics("decode-0", lambda: snapshot, transfer)
    r = m.registry
    node = {"node": "decode-0"}
    assert value(r, "pdmesh:num_requests_running", **node) == 4      # running + waiting for remote KV
    assert value(r, "pdmesh:num_requests_waiting", **node) == 2
    assert value(r, "pdmesh:kv_cache_usage_perc", **node) == 24 / 64
    assert [value(r, f"pdmesh:kv_blocks_{k}", **node) for k in ("total", "used", "free", "cached", "quarantined")] \
        == [64, 24, 40, 10, 4]
    assert value(r, "pdmesh:prefix_cache_queries_total", **node) == 200
    assert value(r, "pdmesh:prefix_cache_hits_total", **node) == 48
    assert value(r, "pdmesh:num_preemptions_total", **node) == 1
    assert value(r, "pdmesh:borrowed_core_steps_total", **node) == 7
    assert value(r, "pdmesh:kv_transfer_bytes_total", node="decode-0", direction="write") == 4096
    assert value(r, "pdmesh:kv_transfer_bytes_total", node="decode-0", direction="read") == 512
    snapshot.update(used_blocks=0, free_blocks=64, quarantined_blocks=0)
    transfer.bytes_written = 8192
    assert value(r, "pdmesh:kv_blocks_used", **node) == 0 and value(r, "pdmesh:kv_cache_usage_perc", **node) == 0
    assert value(r, "pdmesh:kv_transfer_bytes_total", node="decode-0", direction="write") == 8192


def test_node_histograms_carry_the_node_label():
    m = NodeMetrics("prefill-0", lambda: dict(SNAPSHOT), SimpleNamespace(bytes_written=0, bytes_read=0))
    for s in (0.002, 0.03, 0.03):
        m.queue_time.observe(s)
    m.kv_transfer.observe(0.004)
    r, node = m.registry, {"node": "prefill-0"}
    assert value(r, "pdmesh:request_queue_time_seconds_count", **node) == 3
    assert value(r, "pdmesh:request_queue_time_seconds_sum", **node) == pytest.approx(0.062)
    assert value(r, "pdmesh:request_queue_time_seconds_bucket", le="0.005", **node) == 1
    assert value(r, "pdmesh:request_queue_time_seconds_bucket", le="0.04", **node) == 3
    assert value(r, "pdmesh:kv_transfer_seconds_count", **node) == 1
    assert value(r, "pdmesh:kv_transfer_seconds_bucket", le="0.0025", **node) == 0
    assert value(r, "pdmesh:kv_transfer_seconds_bucket", le="0.005", **node) == 1


def make_seq(tokens, rid="r"):
    return Sequence(rid, list(tokens), SamplingParams(), 0)


def computed(bm, seq):
    seq.num_computed_tokens = len(seq)
    bm.cache_full_blocks(seq)


def test_block_manager_counts_free_blocks_that_hold_a_prefix_cache_entry():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq(range(10))                 # 2 full blocks + 2 tokens
    bm.allocate(a)
    computed(bm, a)
    assert bm.num_cached_blocks == 0        # hashed but held: used, not cached
    bm.free(a)
    assert bm.num_cached_blocks == 2        # the partial block is free, not cached
    b = make_seq(list(range(8)) + [50, 51, 52], rid="b")
    bm.allocate(b)                          # hits both cached blocks: used again
    assert b.block_ids[:2] == [0, 1] and bm.num_cached_blocks == 0
    bm.free(b)
    assert bm.num_cached_blocks == 2
    c = make_seq(range(100, 128), rid="c")  # 7 blocks: the 6 uncached ones, then evicts block 1
    bm.allocate(c)
    assert bm.num_cached_blocks == 1 == sum(1 for i in bm.free_queue if bm.blocks[i].hash is not None)
    bm.free(c)
    bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 0


def test_a_real_engine_reports_cached_blocks_after_a_request(llm_factory, tiny_model):
    llm = llm_factory(tiny_model("llama"), num_blocks=32, max_model_len=256, block_size=16)
    llm.engine.block_manager.reset_prefix_cache()   # the engine is shared by the session's tests
    llm.generate([{"prompt_token_ids": list(range(3, 53))}], SamplingParams(max_tokens=4, ignore_eos=True))
    stats = llm.engine.stats()
    # 50 + 3 tokens computed (the last one sampled is not): 3 full blocks of 16 hashed;
    # every block is free again
    assert (stats["used_blocks"], stats["free_blocks"], stats["cached_blocks"]) == (0, 32, 3)
    r = NodeMetrics("n0", llm.engine.stats, SimpleNamespace(bytes_written=0, bytes_read=0)).registry
    assert (value(r, "pdmesh:kv_blocks_cached", node="n0"), value(r, "pdmesh:kv_blocks_free", node="n0")) == (3, 32)


# ---- gateway ---------------------------------------------------------------------------
def test_gateway_timer_observes_ttft_tpot_e2e_and_counts_by_finish_reason(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(gateway_metrics.time, "perf_counter", lambda: clock[0])
    m = GatewayMetrics()
    r = m.registry
    t = m.timer(arrival=99.5)
    assert value(r, "pdmesh:num_requests_running") == 1
    t.on_reply(0, "")            # no token yet (a reply of text only)
    clock[0] = 100.25
    t.on_reply(1, "")            # first token: 0.75 s after arrival
    clock[0] = 100.75
    t.on_reply(2, "")
    clock[0] = 101.25
    t.on_reply(1, "length", num_prompt_tokens=7)   # 4 tokens, 1 s after the first
    t.end("abort")               # after a finish: no-op
    assert value(r, "pdmesh:time_to_first_token_seconds_sum") == 0.75
    assert value(r, "pdmesh:time_to_first_token_seconds_count") == 1
    assert value(r, "pdmesh:time_per_output_token_seconds_sum") == pytest.approx(1.0 / 3)
    assert value(r, "pdmesh:e2e_request_latency_seconds_sum") == 1.75
    assert value(r, "pdmesh:requests_total", finish_reason="length") == 1
    assert value(r, "pdmesh:requests_total", finish_reason="abort") == 0
    assert value(r, "pdmesh:prompt_tokens_total") == 7 and value(r, "pdmesh:generation_tokens_total") == 4
    assert value(r, "pdmesh:num_requests_running") == 0
    one = m.timer()              # one token, then the client leaves: no TPOT, no e2e
    one.on_reply(1, "")
    one.end("abort")
    failed = m.timer()
    failed.end("error")
    assert value(r, "pdmesh:time_to_first_token_seconds_count") == 2
    assert value(r, "pdmesh:time_per_output_token_seconds_count") == 1
    assert value(r, "pdmesh:e2e_request_latency_seconds_count") == 1
    assert [value(r, "pdmesh:requests_total", finish_reason=f) for f in ("length", "abort", "error")] == [1, 1, 1]
    assert value(r, "pdmesh:num_requests_running") == 0


def test_two_gateways_in_one_process_keep_their_own_counts():
    a, b = GatewayMetrics(), GatewayMetrics()
    a.migrations.inc()
    assert value(a.registry, "pdmesh:migrations_total") == 1 and value(b.registry, "pdmesh:migrations_total") == 0


# ---- meta-server -----------------------------------------------------------------------
def member(node_id: str, role: str) -> common_pb2.NodeInfo:
    return common_pb2.NodeInfo(node_id=node_id, role=role, address=f"127.0.0.1:{len(node_id)}", model_id="m",
                               kv_layout=common_pb2.KVLayout(block_size=16, num_blocks=64),
                               load=common_pb2.NodeLoad(free_blocks=64, total_blocks=64))


def test_meta_collector_counts_routes_per_node_and_policy():
    admin = InMemoryAdminState("round_robin")
    control = MetaControl(EmbeddedRegistry(default_ttl_s=5.0), Router(local_prefill_max_tokens=8), admin)
    for node_id, role in (("p0", "prefill"), ("d0", "decode"), ("d1", "decode")):
        control.register(member(node_id, role))
    for _ in range(3):
        control.route(RouteRequest("m", 32))
    control.route(RouteRequest("m", 4))        # short: prefilled on the decode node
    admin._policy = "least_load"
    control.route(RouteRequest("m", 32))
    r = meta_registry(control)
    routed = {(s.labels["node"], s.labels["role"], s.labels["policy"]): s.value
              for f in r.collect() if f.name == "pdmesh:routed" for s in f.samples if s.name.endswith("_total")}
    assert (routed[("d0", "decode", "round_robin")], routed[("d1", "decode", "round_robin")]) == (2, 2)
    assert routed[("p0", "prefill", "round_robin")] == 3
    assert routed[("p0", "prefill", "least_load")] == 1
    assert sum(v for (n, role, p), v in routed.items() if role == "decode") == 5
    assert value(r, "pdmesh:route_decisions_total") == 5
    assert value(r, "pdmesh:local_prefill_total") == 1
    assert value(r, "pdmesh:nodes", role="decode", state="up") == 2
    assert value(r, "pdmesh:nodes", role="prefill", state="up") == 1
    assert value(r, "pdmesh:meta_leader") == 1
    control.router.forget("d0")                # what an operator's remove does: the counter stays
    assert value(r, "pdmesh:routed_total", node="d0", role="decode", policy="round_robin") == 2


# ---- kv-store --------------------------------------------------------------------------
def test_kv_store_collector_reads_stats():
    stats = {"blocks_used": 12, "blocks_total": 100, "blocks_pinned": 2, "hits": 30, "misses": 5, "evictions": 7,
             "bytes_in": 1000, "bytes_out": 3000, "expired_reservations": 0, "expired_pins": 4, "num_spaces": 1,
             "redis_configured": True, "redis_up": True, "redis_spilled": 6, "redis_promoted": 3,
             "redis_errors": 1, "redis_last_error": ""}
    r = kv_store_registry(SimpleNamespace(stats=lambda: stats))
    assert [value(r, f"pdmesh:kv_store_{k}_total") for k in
            ("hits", "misses", "evictions", "expired_pins", "redis_spills", "redis_promotions", "redis_errors",
             "bytes_in", "bytes_out")] == [30, 5, 7, 4, 6, 3, 1, 1000, 3000]
    assert [value(r, f"pdmesh:kv_store_{k}") for k in ("blocks_used", "blocks_total", "blocks_pinned", "redis_up",
                                                       "spaces")] == [12, 100, 2, 1, 1]


# ---- the HTTP server -------------------------------------------------------------------
def get(url: str, method: str = "GET") -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=5) as resp:
            return resp.status, resp.headers["Content-Type"], resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read().decode()


def test_metrics_server_answers_get_metrics_only():
    m = GatewayMetrics()
    m.requests.labels(finish_reason="stop").inc(3)

    async def main():
        server = MetricsServer(m.registry)
        port = await server.start("127.0.0.1", 0)
        base = f"http://127.0.0.1:{port}"
        try:
            status, ctype, body = await asyncio.to_thread(get, f"{base}/metrics")
            assert status == 200 and ctype.startswith("text/plain; version=")
            assert 'pdmesh:requests_total{finish_reason="stop"} 3.0' in body.splitlines()
            assert (await asyncio.to_thread(get, f"{base}/metrics?x=1"))[0] == 200
            assert (await asyncio.to_thread(get, f"{base}/"))[0] == 404
            assert (await asyncio.to_thread(get, f"{base}/metrics", "POST"))[0] == 405
        finally:
            await server.close()
    asyncio.run(main())


def test_meta_server_serves_its_metrics_on_metrics_port():
    from services.meta_server.server import create_server
    port = free_port()

    async def main():
        server, _ = await create_server(MetaConfig(port=0, metrics_port=port))
        try:
            status, _, body = await asyncio.to_thread(get, f"http://127.0.0.1:{port}/metrics")
            assert status == 200 and "pdmesh:meta_leader 1.0" in body.splitlines()
        finally:
            await server.stop(0)
            await server.close_extras()
    asyncio.run(main())


def test_a_taken_metrics_port_stops_the_service_cleanly():
    """The metrics port is taken by another process: create_server fails with BindError
    naming it, and the gRPC port it had bound is closed again (nothing half-started)."""
    import socket
    from services.meta_server.server import create_server
    from common.bind_error import BindError
    from services.node.grpc_util import port_in_use
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    metrics_port, grpc_port = taken.getsockname()[1], free_port()

    async def main():
        with pytest.raises(BindError, match=f"cannot bind the metrics port 127.0.0.1:{metrics_port}"):
            await create_server(MetaConfig(port=grpc_port, metrics_port=metrics_port))
        assert not port_in_use("127.0.0.1", grpc_port), "the gRPC server was stopped"
    try:
        asyncio.run(main())
    finally:
        taken.close()


# ---- config and launcher ---------------------------------------------------------------
@pytest.mark.parametrize("bad", [-1, 65536, "9100", 1.5, True])
def test_metrics_port_is_validated(bad):
    for make in (lambda: MetaConfig(metrics_port=bad), lambda: GatewayConfig(metrics_port=bad),
                 lambda: KVStoreConfig(metrics_port=bad), lambda: NodeConfig("decode", "d0", metrics_port=bad)):
        with pytest.raises(ValueError, match=r"metrics_port must be an integer in \[0, 65535\]"):
            make()


def test_metrics_are_off_by_default():
    mesh = mesh_config_from_dict({"model": "m", "kv_store": {}, "nodes": [{"role": "both", "node_id": "n0"}]})
    assert (mesh.meta.metrics_port, mesh.gateway.metrics_port, mesh.kv_store.metrics_port,
            mesh.nodes[0].metrics_port) == (0, 0, 0, 0)


def test_launcher_refuses_two_services_on_one_metrics_port(tmp_path):
    from services.cli.launcher import MeshProcesses
    port = free_port()
    raw = {"model": "m", "meta_server": {"port": 0, "metrics_port": port}, "gateway": {"port": 0},
           "nodes": [{"role": "both", "node_id": "n0", "metrics_port": port}]}
    mesh = MeshProcesses(str(tmp_path / "mesh.yaml"), mesh_config_from_dict(raw), tmp_path, quiet=True)
    with pytest.raises(RuntimeError, match=f"n0 metrics and meta-server metrics both have port 127.0.0.1:{port}"):
        mesh.start(timeout_s=5)


def test_launcher_status_line_names_the_metrics_address(tmp_path):
    from services.cli.launcher import Service
    svc = Service("decode-0", "decode", "127.0.0.1", 7001, [], tmp_path / "x.log", metrics_port=9101)
    svc.process = SimpleNamespace(pid=42)
    assert svc.status("healthy") == ("decode-0     decode      healthy at 127.0.0.1:7001, "
                                     "metrics at http://127.0.0.1:9101/metrics (pid 42)")


def test_exported_names_include_families_without_samples():
    control = MetaControl(EmbeddedRegistry(default_ttl_s=5.0), Router(), InMemoryAdminState("round_robin"))
    names = exported_names(meta_registry(control))     # nothing routed yet
    assert {"pdmesh:routed_total", "pdmesh:nodes", "pdmesh:meta_leader"} <= names
    assert {"pdmesh:time_to_first_token_seconds_bucket", "pdmesh:requests_total"} <= exported_names(
        GatewayMetrics().registry)


def test_serve_advertise_host_override_sets_the_role_s_own_host():
    from services.cli.serve import _with_advertise_host
    mesh = mesh_config_from_dict({"model": "m", "kv_store": {}, "nodes": [{"role": "both", "node_id": "n0"}]})
    assert _with_advertise_host(mesh, None, "meta-server", "meta-1.meta")[0].meta.address.startswith("meta-1.meta:")
    assert _with_advertise_host(mesh, None, "kv-store", "kv-0.kv")[0].kv_store.advertise_host == "kv-0.kv"
    assert _with_advertise_host(mesh, mesh.nodes[0], "both", "n0.pods")[1].advertised_host == "n0.pods"
    with pytest.raises(ValueError, match="--advertise-host is not served for gateway"):
        _with_advertise_host(mesh, None, "gateway", "g")


def test_serve_metrics_port_override_sets_the_role_s_own_port():
    from services.cli.serve import _with_metrics_port
    mesh = mesh_config_from_dict({"model": "m", "kv_store": {}, "nodes": [{"role": "both", "node_id": "n0"}]})
    assert _with_metrics_port(mesh, None, "meta-server", 9101)[0].meta.metrics_port == 9101
    assert _with_metrics_port(mesh, None, "gateway", 9102)[0].gateway.metrics_port == 9102
    assert _with_metrics_port(mesh, None, "kv-store", 9103)[0].kv_store.metrics_port == 9103
    assert _with_metrics_port(mesh, mesh.nodes[0], "both", 9104)[1].metrics_port == 9104
