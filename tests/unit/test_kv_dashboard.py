"""The KV-memory dashboard: the /api/cluster builder with exact values, the router's
prefix hit counters, the HTTP server in-process (auth, routes, a self-contained page), and
`pdmesh top --once` against it."""
from __future__ import annotations

import asyncio
import json
import os
import re
import urllib.error
import urllib.request

import pytest

from common.config import MetaConfig
from protos.pdmesh.v1 import common_pb2, meta_pb2, meta_pb2_grpc
from services.meta_server.control import NodeStatus
from services.meta_server.dashboard.cluster_view import build_cluster, node_blocks
from services.meta_server.dashboard.http import page_html
from services.meta_server.router import Router
from services.meta_server.server import create_server
from tests.channels import operator_channel
from tests.server_process import free_port


def info(node_id, role, total=64, free=40, cached=10, quarantined=4, written=0, running=3, waiting=1):
    return common_pb2.NodeInfo(node_id=node_id, role=role, address=f"10.0.0.1:{len(node_id)}", model_id="m",
                               kv_layout=common_pb2.KVLayout(block_size=16, num_blocks=total),
                               load=common_pb2.NodeLoad(running=running, waiting=waiting, free_blocks=free,
                                                        total_blocks=total, cached_blocks=cached,
                                                        quarantined_blocks=quarantined,
                                                        transfer_bytes_written=written))


def test_node_blocks_segments_add_up_to_total():
    assert node_blocks(info("d0", "decode").load) == {"total": 64, "used": 20, "quarantined": 4,
                                                     "cached": 10, "free": 30}
    idle = info("d0", "decode", free=64, cached=0, quarantined=0).load
    assert node_blocks(idle) == {"total": 64, "used": 0, "quarantined": 0, "cached": 0, "free": 64}
    # an old node that reports no cached/quarantined counts: all held blocks are used
    old = common_pb2.NodeLoad(free_blocks=50, total_blocks=64)
    assert node_blocks(old) == {"total": 64, "used": 14, "quarantined": 0, "cached": 0, "free": 50}


def test_build_cluster_exact_document():
    router = Router()
    router.num_routed, router.num_local_prefill, router.num_query_blocks, router.num_hit_blocks = 5, 1, 40, 10
    statuses = [NodeStatus(info("p0", "prefill", written=4096), "up", 0.25, 2),
                NodeStatus(info("d0", "decode", free=64, cached=8, quarantined=0, running=0, waiting=0),
                           "draining", 1.0, 3),
                NodeStatus(info("d1", "decode"), "down", 9.5, 0)]
    doc = build_cluster(statuses, router, "cache_aware", True, 1000.0, {"p0": 2048.0},
                        {"address": "k:1", "reachable": False, "error": "UNAVAILABLE"})
    assert doc == {
        "time": 1000.0, "policy": "cache_aware", "leader": True,
        "nodes": [
            {"node_id": "p0", "role": "prefill", "state": "up", "address": "10.0.0.1:2", "model_id": "m",
             "seconds_since_heartbeat": 0.25, "num_routed": 2,
             "load": {"running": 3, "waiting": 1, "stalled": False},
             "blocks": {"total": 64, "used": 20, "quarantined": 4, "cached": 10, "free": 30},
             "transfer_bytes_written": 4096, "transfer_bytes_per_s": 2048.0},
            {"node_id": "d0", "role": "decode", "state": "draining", "address": "10.0.0.1:2", "model_id": "m",
             "seconds_since_heartbeat": 1.0, "num_routed": 3,
             "load": {"running": 0, "waiting": 0, "stalled": False},
             "blocks": {"total": 64, "used": 0, "quarantined": 0, "cached": 8, "free": 56},
             "transfer_bytes_written": 0, "transfer_bytes_per_s": 0.0},
            {"node_id": "d1", "role": "decode", "state": "down", "address": "10.0.0.1:2", "model_id": "m",
             "seconds_since_heartbeat": 9.5, "num_routed": 0,
             "load": {"running": 3, "waiting": 1, "stalled": False},
             "blocks": {"total": 64, "used": 20, "quarantined": 4, "cached": 10, "free": 30},
             "transfer_bytes_written": 0, "transfer_bytes_per_s": 0.0}],
        "totals": {"total": 128, "used": 20, "quarantined": 4, "cached": 18, "free": 86},   # down d1 left out
        "router": {"num_routed": 5, "num_local_prefill": 1, "num_query_blocks": 40, "num_hit_blocks": 10,
                   "prefix_hit_rate": 0.25},
        "transfer_bytes_per_s": 2048.0,
        "kv_store": {"address": "k:1", "reachable": False, "error": "UNAVAILABLE"}}


def test_page_is_self_contained():
    page = page_html().decode()
    assert "<style>" in page and "<script>" in page
    assert not re.search(r"<(script|link|img|iframe)[^>]+(src|href)=", page)
    assert "http://" not in page and "https://" not in page


def _get(url, token=None):
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=5) as reply:
            return reply.status, reply.headers.get("Content-Type"), reply.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type"), e.read()


def test_dashboard_http_auth_json_and_top(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")     # rich: no wrapping of the table
    token = os.environ["PDMESH_ADMIN_TOKEN"]
    hashes = [bytes([i]) * 32 for i in range(4)]

    async def main():
        port = free_port()
        server, grpc_port = await create_server(MetaConfig(port=0, dashboard_port=port, ttl_seconds=30))
        base = f"http://127.0.0.1:{server.dashboard.port}"
        try:
            async with operator_channel(f"127.0.0.1:{grpc_port}") as ch:
                meta, admin = meta_pb2_grpc.MetaServerStub(ch), meta_pb2_grpc.MetaAdminStub(ch)
                for node_id, role in (("p0", "prefill"), ("d0", "decode"), ("d1", "decode")):
                    await meta.Register(meta_pb2.RegisterRequest(node=info(node_id, role)))
                for _ in range(2):   # the second is predicted to hit all 4 blocks on p0
                    await meta.Route(meta_pb2.RouteRequest(model_id="m", num_prompt_tokens=64,
                                                           block_hashes=hashes))
                await admin.DrainNode(meta_pb2.DrainNodeRequest(node_id="d1"))
            loop = asyncio.get_running_loop()
            get = lambda *a: loop.run_in_executor(None, _get, *a)    # noqa: E731
            assert (await get(f"{base}/api/cluster"))[0] == 401
            assert (await get(f"{base}/api/cluster", "wrong"))[0] == 401
            assert (await get(f"{base}/nope", token))[0] == 404
            status, ctype, body = await get(f"{base}/dashboard")   # the page holds no data
            assert (status, ctype) == (200, "text/html; charset=utf-8") and body == page_html()
            assert (await get(f"{base}/api/cluster?token={token}"))[0] == 401, "never a token in the URL"
            status, ctype, body = await get(f"{base}/api/cluster", token)
            assert (status, ctype) == (200, "application/json")
            doc = json.loads(body)
            assert [(n["node_id"], n["state"]) for n in doc["nodes"]] == [
                ("p0", "up"), ("d0", "up"), ("d1", "draining")]
            assert doc["router"] == {"num_routed": 2, "num_local_prefill": 0, "num_query_blocks": 8,
                                     "num_hit_blocks": 4, "prefix_hit_rate": 0.5}
            assert doc["kv_store"] is None and doc["leader"] is True
            from services.cli import main as cli
            code = await loop.run_in_executor(None, cli, ["top", "--dashboard", base, "--once"])
            assert code == 0
        finally:
            await server.stop(0)
            await server.close_extras()

    asyncio.run(main())
    out = capsys.readouterr().out
    for node_id in ("p0", "d0", "d1"):
        assert node_id in out
    assert "draining" in out and "prefix hit rate 50.0%" in out


def test_dashboard_port_validated():
    with pytest.raises(ValueError, match=r"dashboard_port must be an integer in \[0, 65535\]"):
        MetaConfig(dashboard_port=70000)
    assert MetaConfig().dashboard_port == 0


def test_kv_store_entry_from_a_real_store_and_an_absent_one():
    from common.config import KVStoreConfig, MeshConfig, TransferConfig
    from services.kv_store.server import create_server as create_store, stop_server
    from services.meta_server.dashboard.cluster_view import ClusterView

    async def main():
        mesh = MeshConfig(model="unused", meta=MetaConfig(port=free_port()),
                          transfer=TransferConfig(backend="mooncake"),
                          kv_store=KVStoreConfig(port=0, capacity_mb=1))
        store, port = await create_store(mesh, 0)
        view, gone = ClusterView(None, f"127.0.0.1:{port}"), ClusterView(None, f"127.0.0.1:{free_port()}")
        try:
            entry = await view.kv_store_entry()
            assert entry["address"] == f"127.0.0.1:{port}" and entry["reachable"] is True
            assert entry["blocks_used"] == 0 and entry["hits"] == 0 and entry["redis_configured"] is False
            assert (entry["blocks_total"], entry["num_spaces"], entry["redis_spilled"]) == (0, 0, 0)   # no space yet
            assert await gone.kv_store_entry() == {"address": gone.kv_store_address, "reachable": False,
                                                   "error": "UNAVAILABLE"}
            assert await ClusterView(None).kv_store_entry() is None
        finally:
            await view.close()
            await gone.close()
            await stop_server(store, 0)

    asyncio.run(main())


def test_transfer_rate_between_heartbeats():
    from services.meta_server.dashboard.cluster_view import ClusterView
    view = ClusterView(None)
    at = lambda written, since: [NodeStatus(info("p0", "prefill", written=written), "up", since, 0)]   # noqa: E731
    assert view._rates(at(1000, 0.0), 100.0) == {}              # one heartbeat seen
    assert view._rates(at(1000, 0.5), 100.5) == {}              # the same heartbeat again
    assert view._rates(at(3000, 0.0), 102.0) == {"p0": 1000.0}  # 2000 bytes over 2 s
    assert view._rates(at(3000, 0.3), 102.3) == {"p0": 1000.0}
    assert view._rates(at(100, 0.0), 103.0) == {"p0": 0.0}      # restarted: counter went down


def test_top_keeps_the_last_table_when_a_refresh_fails(capsys, monkeypatch):
    """A refresh that fails (the meta-server restarting, say) does not end `pdmesh top`:
    the last table stays under a red line with the reason, and the next refresh that
    works replaces it."""
    from services.cli import main as cli
    from services.cli import top
    monkeypatch.setenv("COLUMNS", "250")
    doc = build_cluster([NodeStatus(info("p0", "prefill"), "up", 0.25, 2)], Router(), "least_load", True,
                        1000.0, {}, None)
    later = build_cluster([NodeStatus(info("p9", "prefill"), "up", 0.25, 2)], Router(), "least_load", True,
                          1001.0, {}, None)
    answers = [doc, RuntimeError("http://127.0.0.1:1/api/cluster: HTTP 503: restarting"), later]
    shown = []

    def fetch(url, token):
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def sleep(_):
        if not answers:
            raise KeyboardInterrupt   # the user's ^C: exit 0
    monkeypatch.setattr(top, "fetch", fetch)
    monkeypatch.setattr(top.time, "sleep", sleep)
    real_stale = top.stale
    monkeypatch.setattr(top, "stale", lambda table, why: shown.append(why) or real_stale(table, why))
    assert cli(["top", "--dashboard", "127.0.0.1:1", "--interval", "0"]) == 0   # the session's admin token
    assert len(shown) == 1 and shown[0].startswith("unreachable since ")
    assert shown[0].endswith(": http://127.0.0.1:1/api/cluster: HTTP 503: restarting; retrying")
    out = capsys.readouterr().out
    assert "p9" in out, "the refresh after the failure drew the new table"
