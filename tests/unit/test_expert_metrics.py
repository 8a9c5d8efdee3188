"""Expert load leaves the node: `pdmesh:moe_expert_tokens_total{node,layer,expert}` on its
/metrics (services/node/metrics.py), HeartbeatRequest.expert_tokens (never its NodeInfo), the node's
"experts" entry of the meta-server's /api/cluster (cluster_view.py) and the hot-expert
lines of `pdmesh top` (services/cli/top.py): exact values from known counts, then a real
decode node serving the tiny Qwen3-MoE model next to a real meta-server, in this process."""
from __future__ import annotations

import asyncio
import json
import os
import time
import urllib.request
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.config import MeshConfig, MetaConfig, NodeConfig, TransferConfig
from protos.pdmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from services.cli.top import expert_lines, hot_experts, render
from services.meta_server.control import NodeStatus
from services.meta_server.dashboard.cluster_view import build_cluster
from services.meta_server.router import Router
from services.meta_server.server import create_server
from services.node.metrics import NodeMetrics
from services.node.node_server import create_node_server, stop_node_server
from tests.channels import operator_channel
from tests.conftest import assert_no_blocks_in_use
from tests.server_process import free_port

pytestmark = pytest.mark.timeout(180)
SNAPSHOT = {"running": 0, "waiting": 0, "kv_remote": 0, "held": 0, "free_blocks": 64, "used_blocks": 0,
            "total_blocks": 64, "prefix_hit_tokens": 0, "prefix_query_tokens": 0, "preemptions": 0,
            "quarantined_blocks": 0, "cached_blocks": 0, "borrowed_core_steps": 0}
NO_BYTES = SimpleNamespace(bytes_written=0, bytes_read=0)
COUNTS = {0: [10, 30, 0, 60], 2: [25, 25, 25, 25], 3: [0, 0, 0, 0]}   # layer 3 routed nothing yet
HANG_GUARD_S = 30.0


def expert_samples(registry) -> dict[tuple[str, str, str], float]:
    return {(s.labels["node"], s.labels["layer"], s.labels["expert"]): s.value
            for family in registry.collect() if family.name == "pdmesh:moe_expert_tokens"
            for s in family.samples if s.name == "pdmesh:moe_expert_tokens_total"}


def test_expert_counter_has_one_series_per_layer_and_expert_and_none_for_a_dense_model():
    counts = {0: [1, 2], 3: [0, 7]}
    moe = NodeMetrics("decode-0", lambda: dict(SNAPSHOT), NO_BYTES, expert_tokens=lambda: counts).registry
    assert expert_samples(moe) == {("decode-0", "0", "0"): 1, ("decode-0", "0", "1"): 2,
                                   ("decode-0", "3", "0"): 0, ("decode-0", "3", "1"): 7}
    counts[3] = [4, 7]                                    # read at scrape time
    assert moe.get_sample_value("pdmesh:moe_expert_tokens_total",
                                {"node": "decode-0", "layer": "3", "expert": "0"}) == 4
    dense = NodeMetrics("decode-1", lambda: dict(SNAPSHOT), NO_BYTES, expert_tokens=dict).registry
    assert expert_samples(dense) == {}
    assert not any(f.name == "pdmesh:moe_expert_tokens" for f in dense.collect())


def status(node_id: str, counts: dict[int, list[int]] | None = None) -> NodeStatus:
    load = common_pb2.NodeLoad(free_blocks=64, total_blocks=64)
    return NodeStatus(common_pb2.NodeInfo(node_id=node_id, role="decode", address="10.0.0.1:1", model_id="m",
                                          load=load), "up", 0.5, 0, counts or {})


def test_the_cluster_document_carries_the_expert_load_of_moe_nodes_only():
    doc = build_cluster([status("d0", COUNTS), status("d1")], Router(), "round_robin", True, 1000.0)
    assert doc["nodes"][0]["experts"] == {"layers": [0, 2, 3],
                                          "num_tokens": [[10, 30, 0, 60], [25, 25, 25, 25], [0, 0, 0, 0]]}
    assert "experts" not in doc["nodes"][1]
    assert json.loads(json.dumps(doc)) == doc


def test_top_shows_the_most_loaded_experts_of_each_moe_node():
    doc = build_cluster([status("d0", COUNTS), status("d1"), status("d2", {5: [3, 1]})], Router(),
                        "round_robin", True, 1000.0)
    assert hot_experts(doc["nodes"][0]["experts"]) == [(0, 3, 0.6), (0, 1, 0.3), (2, 0, 0.25)]
    assert hot_experts(doc["nodes"][0]["experts"], 5)[3:] == [(2, 1, 0.25), (2, 2, 0.25)]   # ties: layer, expert
    assert expert_lines(doc) == ["d0 hot experts: L0 E3 60.0% · L0 E1 30.0% · L2 E0 25.0%",
                                 "d2 hot experts: L5 E0 75.0% · L5 E1 25.0%"]
    idle = build_cluster([status("d0", {0: [0, 0]})], Router(), "round_robin", True, 1000.0)
    assert expert_lines(idle) == ["d0 hot experts: no token routed yet"]
    assert expert_lines(build_cluster([status("d1")], Router(), "round_robin", True, 1000.0)) == []
    from rich.console import Console
    console = Console(width=250, record=True)
    console.print(render(doc))
    lines = console.export_text().splitlines()
    assert lines[-2:] == expert_lines(doc)


def scrape(port: int) -> dict[tuple[str, str, str], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return {(s.labels["node"], s.labels["layer"], s.labels["expert"]): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == "pdmesh:moe_expert_tokens_total"}


def cluster(port: int) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/api/cluster",
                                     headers={"Authorization": f"Bearer {os.environ['PDMESH_ADMIN_TOKEN']}"})
    with urllib.request.urlopen(request, timeout=5) as reply:
        return json.loads(reply.read())


def test_a_moe_node_exports_exact_expert_counts_and_reports_them_to_the_dashboard(tiny_model, capsys,
                                                                                 monkeypatch):
    """A greedy request of 40 prompt tokens and 6 output tokens runs 45 tokens through each
    of the 4 MoE layers: 90 routed tokens a layer (top 2), on /metrics as soon as the
    stream ended, in the next heartbeat on the meta-server's /api/cluster, in `pdmesh top`."""
    monkeypatch.setenv("COLUMNS", "250")
    model = tiny_model("qwen3_moe")
    metrics_port, dashboard_port = free_port(), free_port()

    async def main():
        loop = asyncio.get_running_loop()
        meta, meta_port = await create_server(MetaConfig(port=0, dashboard_port=dashboard_port, ttl_seconds=1.0))
        mesh = MeshConfig(model=str(model), engine={"num_blocks": 64, "max_model_len": 512},
                          meta=MetaConfig(port=meta_port, ttl_seconds=1.0), transfer=TransferConfig(backend="fake"))
        node_server, port = await create_node_server(
            mesh, NodeConfig("decode", "decode-0", metrics_port=metrics_port), 0)
        engine = node_server.node.llm_engine
        try:
            assert await loop.run_in_executor(None, scrape, metrics_port) == {
                ("decode-0", str(layer), str(e)): 0 for layer in range(4) for e in range(8)}
            req = engine_pb2.DecodeRequest(request_id="moe-1", prompt_token_ids=list(range(5, 45)))
            req.sampling.max_tokens, req.sampling.temperature, req.sampling.ignore_eos = 6, 0.0, True
            async with operator_channel(f"127.0.0.1:{port}") as ch:
                replies = [r async for r in engine_pb2_grpc.DecodeStub(ch).Generate(req, timeout=60)]
            assert sum(len(r.token_ids) for r in replies) == 6
            counts = engine.expert_tokens()
            assert {layer: sum(row) for layer, row in counts.items()} == dict.fromkeys(range(4), (40 + 6 - 1) * 2)
            samples = await loop.run_in_executor(None, scrape, metrics_port)
            assert samples == {("decode-0", str(layer), str(e)): n
                               for layer, row in counts.items() for e, n in enumerate(row)}
            start = time.monotonic()
            while True:   # the next heartbeat (every TTL/3) carries them
                doc = await loop.run_in_executor(None, cluster, dashboard_port)
                entry = next(n for n in doc["nodes"] if n["node_id"] == "decode-0")
                if entry.get("experts") == {"layers": [0, 1, 2, 3], "num_tokens": [counts[i] for i in range(4)]}:
                    break
                assert time.monotonic() - start < HANG_GUARD_S, f"no heartbeat with the counts: {entry}"
                await asyncio.sleep(0.05)
            from services.cli import main as cli
            assert await loop.run_in_executor(None, cli, ["top", "--dashboard", f"127.0.0.1:{dashboard_port}",
                                                          "--once"]) == 0
            assert_no_blocks_in_use(engine)
        finally:
            await stop_node_server(node_server, 0.5)
            await meta.stop(None)
            await meta.close_extras()
        return doc

    doc = asyncio.run(main())
    [line] = expert_lines(doc)
    assert line.startswith("decode-0 hot experts: L") and line in capsys.readouterr().out.splitlines()
