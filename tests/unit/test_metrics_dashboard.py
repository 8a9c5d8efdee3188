"""deploy/grafana/pdmesh.json: every panel expression parses as PromQL, and every metric
it names is one the services export (the names come from each service's own registry:
services/gateway/metrics.py, services/node/metrics.py, services/meta_server/metrics.py,
services/kv_store/metrics.py). tests/integration/test_metrics_mesh.py checks the same
names against a real mesh's /metrics."""
from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import promql_parser
import pytest

from common.config import KVStoreConfig
from common.metrics import exported_names
from common.transfer.fake import FakeTransfer
from services.gateway.metrics import GatewayMetrics
from services.kv_store.metrics import kv_store_registry
from services.kv_store.store import KVStore
from services.meta_server.admin_state import InMemoryAdminState
from services.meta_server.control import MetaControl
from services.meta_server.metrics import meta_registry
from services.meta_server.registry import EmbeddedRegistry
from services.meta_server.router import Router
from services.node.metrics import NodeMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "pdmesh.json"
GRAFANA_VARIABLES = re.compile(r"\$__(rate_interval|interval|range)\b|\$\{__(rate_interval|interval|range)\}")
SNAPSHOT_KEYS = ("running", "waiting", "kv_remote", "held", "free_blocks", "used_blocks", "total_blocks",
                 "prefix_hit_tokens", "prefix_query_tokens", "preemptions", "quarantined_blocks", "cached_blocks",
                 "borrowed_core_steps")
# what issue 15 asks the dashboard to show, by the metric that carries it
REQUIRED = {"pdmesh:time_to_first_token_seconds_bucket", "pdmesh:time_per_output_token_seconds_bucket",
            "pdmesh:generation_tokens_total", "pdmesh:kv_cache_usage_perc", "pdmesh:prefix_cache_hits_total",
            "pdmesh:prefix_cache_queries_total", "pdmesh:kv_transfer_bytes_total"}


def service_names() -> set[str]:
    """Every series name of every service's registry."""
    control = MetaControl(EmbeddedRegistry(default_ttl_s=5.0), Router(), InMemoryAdminState("least_load"))
    snapshot = dict.fromkeys(SNAPSHOT_KEYS, 0)
    node = NodeMetrics("n0", lambda: snapshot, SimpleNamespace(bytes_written=0, bytes_read=0))
    store = KVStore(KVStoreConfig(), FakeTransfer())
    registries = [GatewayMetrics().registry, node.registry, meta_registry(control), kv_store_registry(store)]
    return set().union(*(exported_names(r) for r in registries))


def expressions() -> list[tuple[str, str]]:
    """(panel title, expr) of every target of the dashboard."""
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]


def metric_names(expr: str) -> set[str]:
    """The metric names expr selects (ValueError when it does not parse)."""
    ast = promql_parser.parse(GRAFANA_VARIABLES.sub("5m", expr))
    names: set[str] = set()

    def visit(node):
        if isinstance(node, promql_parser.VectorSelector):
            names.add(node.name or next(m.value for m in node.matchers.matchers if m.name == "__name__"))

    promql_parser.walk(ast, visit)
    return names


def test_metric_names_of_an_expression():
    assert metric_names("histogram_quantile(0.9, sum by (le) (rate(pdmesh:a_bucket[$__rate_interval])))"
                        " / on() pdmesh:b{node=\"x\"}") == {"pdmesh:a_bucket", "pdmesh:b"}
    with pytest.raises(ValueError):
        metric_names("sum(rate(pdmesh:a[5m])")


def test_every_dashboard_expression_names_metrics_the_services_export():
    exported = service_names()
    used: set[str] = set()
    for title, expr in expressions():
        names = metric_names(expr)
        assert names, f"{title}: {expr} selects no metric"
        unknown = names - exported
        assert not unknown, f"{title}: {expr} uses {sorted(unknown)}, which no service exports"
        used |= names
    assert REQUIRED <= used, f"the dashboard shows nothing of {sorted(REQUIRED - used)}"


def test_dashboard_is_importable():
    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) and dash["uid"] == "pdmesh"
    assert [v["name"] for v in dash["templating"]["list"]] == ["datasource"]
    for p in dash["panels"]:
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert {"x", "y", "w", "h"} <= set(p["gridPos"]), p["title"]
