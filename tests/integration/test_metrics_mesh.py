"""Prometheus /metrics of a real mesh (meta-server, kv-store, prefill-0, decode-0, gateway;
Mooncake over TCP): each service's metrics_port, scraped over HTTP, counts exactly the
requests sent, and names every metric the Grafana dashboard uses. The requests are sent
once, by a module fixture, whichever test runs first."""
from __future__ import annotations

import asyncio
import urllib.request
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.node.grpc_util import free_port
from tests.integration.conftest import engine_stats, mixed_prompts
from tests.integration.test_mesh import assert_no_blocks_in_use, kv_store_stats, request, stream
from tests.unit.test_metrics_dashboard import expressions, metric_names

NUM_REQUESTS, MAX_TOKENS = 4, 6
SERVICES = ("meta-server", "kv-store", "prefill-0", "decode-0", "gateway")


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def metrics_mesh(model, start_mesh):
    ports = {name: free_port() for name in SERVICES}
    nodes = [{"role": "prefill", "node_id": "prefill-0", "metrics_port": ports["prefill-0"]},
             {"role": "decode", "node_id": "decode-0", "metrics_port": ports["decode-0"]}]
    top = {"nodes": nodes, "gateway": {"port": 0, "metrics_port": ports["gateway"]},
           "kv_store": {"port": 0, "capacity_mb": 16, "metrics_port": ports["kv-store"]}}
    return start_mesh(model, top=top, metrics_port=ports["meta-server"])


def scrape(mesh, name: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of the service's /metrics."""
    url = mesh.services[name].metrics_address
    with urllib.request.urlopen(url, timeout=5) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def total(samples, metric: str, **labels) -> float:
    """The sum over the series of metric whose labels include labels."""
    return sum(v for (n, ls), v in samples.items()
               if n == metric and set(labels.items()) <= set(ls))


@pytest.fixture(scope="module")
def sent(metrics_mesh):
    """The only requests the mesh serves: NUM_REQUESTS random prompts, sent once, then
    (every node idle) each service's scrape, next to the counters it must agree with."""
    mesh = metrics_mesh
    prompts = mixed_prompts(NUM_REQUESTS, seed=11)
    pushed_before = engine_stats(mesh.services["prefill-0"].address, "prefill").transfer_bytes_written

    async def send_all():
        return await asyncio.gather(*(stream(mesh.gateway_address, request(p, max_tokens=MAX_TOKENS))
                                      for p in prompts))

    results = asyncio.run(asyncio.wait_for(send_all(), 120))
    assert_no_blocks_in_use(mesh)
    scrapes = {name: scrape(mesh, name) for name in SERVICES if name != "kv-store"}
    prefill_stats = engine_stats(mesh.services["prefill-0"].address, "prefill")
    scrapes["kv-store"] = scrape(mesh, "kv-store")
    store_stats = kv_store_stats(mesh.services["kv-store"].address)
    return SimpleNamespace(prompts=prompts, results=results, pushed_before=pushed_before, scrapes=scrapes,
                           prefill_stats=prefill_stats, store_stats=store_stats)


def test_every_service_counts_the_requests_exactly(sent):
    assert sent.pushed_before == 0
    assert all(msgs[-1].finish_reason == "length" and len(tokens) == MAX_TOKENS for tokens, _, msgs in sent.results)
    num_prompt_tokens = sum(len(p) for p in sent.prompts)

    gw = sent.scrapes["gateway"]
    assert total(gw, "pdmesh:requests_total", finish_reason="length") == NUM_REQUESTS
    assert total(gw, "pdmesh:requests_total") == NUM_REQUESTS        # no stop, abort or error
    for h in ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds"):
        assert total(gw, f"pdmesh:{h}_count") == NUM_REQUESTS, h
        assert total(gw, f"pdmesh:{h}_bucket", le="+Inf") == NUM_REQUESTS, h
    assert total(gw, "pdmesh:generation_tokens_total") == NUM_REQUESTS * MAX_TOKENS
    assert total(gw, "pdmesh:prompt_tokens_total") == num_prompt_tokens
    assert total(gw, "pdmesh:migrations_total") == 0
    assert total(gw, "pdmesh:num_requests_running") == 0

    meta = sent.scrapes["meta-server"]
    assert total(meta, "pdmesh:routed_total", role="decode") == NUM_REQUESTS
    assert total(meta, "pdmesh:routed_total", node="decode-0", policy="least_load") == NUM_REQUESTS
    assert total(meta, "pdmesh:routed_total", node="prefill-0") == NUM_REQUESTS   # none prefilled locally
    assert total(meta, "pdmesh:route_decisions_total") == NUM_REQUESTS
    assert total(meta, "pdmesh:local_prefill_total") == 0
    assert total(meta, "pdmesh:nodes", role="decode", state="up") == 1
    assert total(meta, "pdmesh:meta_leader") == 1

    for name in ("prefill-0", "decode-0"):
        node = sent.scrapes[name]
        assert {dict(ls).get("node") for (n, ls) in node if n.startswith("pdmesh:")} == {name}
        assert total(node, "pdmesh:request_queue_time_seconds_count") == NUM_REQUESTS, name
        assert total(node, "pdmesh:prefix_cache_queries_total") == num_prompt_tokens, name
        assert total(node, "pdmesh:prefix_cache_hits_total") == 0, name      # random prompts
        blocks = {k: total(node, f"pdmesh:kv_blocks_{k}") for k in ("used", "quarantined", "free", "total")}
        assert blocks == {"used": 0, "quarantined": 0, "free": 512, "total": 512}, name
        assert total(node, "pdmesh:kv_cache_usage_perc") == 0
        assert total(node, "pdmesh:num_requests_running") == total(node, "pdmesh:num_requests_waiting") == 0
    prefill = sent.scrapes["prefill-0"]
    assert total(prefill, "pdmesh:kv_transfer_seconds_count") == NUM_REQUESTS
    assert total(prefill, "pdmesh:kv_transfer_bytes_total", direction="write") == \
        sent.prefill_stats.transfer_bytes_written > 0
    assert 0 < total(prefill, "pdmesh:kv_blocks_cached") <= 512

    store, stats = sent.scrapes["kv-store"], sent.store_stats
    assert total(store, "pdmesh:kv_store_blocks_used") == stats.blocks_used > 0   # the prompts' full blocks
    assert (total(store, "pdmesh:kv_store_hits_total"), total(store, "pdmesh:kv_store_misses_total")) == (
        stats.hits, stats.misses)
    assert total(store, "pdmesh:kv_store_blocks_pinned") == 0


def test_the_dashboard_uses_only_metrics_the_mesh_exports(sent):
    # a histogram's series show once observed, a labelled counter once counted: after the
    # requests `sent` made, every family the dashboard reads has samples
    exported = set().union(*({n for n, _ in samples} for samples in sent.scrapes.values()))
    used = set().union(*(metric_names(expr) for _, expr in expressions()))
    missing = used - exported
    assert not missing, f"the dashboard reads {sorted(missing)}, which the mesh does not export"


def test_launcher_names_each_metrics_address(metrics_mesh):
    for name in SERVICES:
        svc = metrics_mesh.services[name]
        assert svc.metrics_address == f"http://{svc.host}:{svc.metrics_port}/metrics"
        assert svc.metrics_address in svc.status("healthy")
