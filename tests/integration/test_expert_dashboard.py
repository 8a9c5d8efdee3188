"""The dashboard's expert-load heat map in a real browser (Debian's chromium driven by
Playwright's async API) against a meta-server in this process, with a Mixture-of-Experts
node and a dense one registered over gRPC, the MoE node's counts in its heartbeats (never in
its NodeInfo): one heat map, for the MoE node only, with a cell per (layer, expert), the
largest share darkest, redrawn from the next heartbeat that carries counts.
Skips only when chromium is not installed (`make sysdeps` installs it)."""
from __future__ import annotations

import asyncio
import os
import shutil

import pytest

from common.config import MetaConfig
from protos.pdmesh.v1 import common_pb2, meta_pb2, meta_pb2_grpc
from services.meta_server.server import create_server
from tests.channels import operator_channel
from tests.server_process import free_port

CHROMIUM = shutil.which("chromium")
pytestmark = [pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (make sysdeps)"),
              pytest.mark.timeout(180)]
NUM_LAYERS, NUM_EXPERTS = 4, 8
HOT, COLD = "rgb(217, 83, 79)", "rgb(42, 48, 56)"     # dashboard.html's shading ends
HANG_GUARD_MS = 30_000


LOAD = common_pb2.NodeLoad(free_blocks=64, total_blocks=64)


def node(node_id: str) -> common_pb2.NodeInfo:
    return common_pb2.NodeInfo(node_id=node_id, role="decode", address=f"10.0.0.1:{len(node_id)}", model_id="m",
                               kv_layout=common_pb2.KVLayout(block_size=16, num_blocks=64), load=LOAD)


def heartbeat(counts: list[list[int]]) -> meta_pb2.HeartbeatRequest:
    return meta_pb2.HeartbeatRequest(node_id="moe-0", load=LOAD, instance_id="a", expert_tokens=common_pb2.ExpertTokens(
        layers=[common_pb2.LayerExpertTokens(layer=i, num_tokens=row) for i, row in enumerate(counts)]))


def test_heat_map_has_a_cell_per_layer_and_expert_of_the_moe_node_only():
    # every layer routes 2 tokens to each expert, but layer 2 sends 20 to expert 5 (the hottest share)
    counts = [[2] * NUM_EXPERTS for _ in range(NUM_LAYERS)]
    counts[2][5] = 20
    counts[3][0] = 0

    async def main():
        from playwright.async_api import async_playwright
        meta, grpc_port = await create_server(MetaConfig(port=0, dashboard_port=free_port(), ttl_seconds=30))
        try:
            async with operator_channel(f"127.0.0.1:{grpc_port}") as ch:
                stub = meta_pb2_grpc.MetaServerStub(ch)
                await stub.Register(meta_pb2.RegisterRequest(node=node("moe-0"), instance_id="a"))
                await stub.Register(meta_pb2.RegisterRequest(node=node("dense-0"), instance_id="b"))
                await stub.Heartbeat(heartbeat(counts))
                await stub.Heartbeat(meta_pb2.HeartbeatRequest(node_id="dense-0", load=LOAD, instance_id="b"))
                async with async_playwright() as p:
                    browser = await p.chromium.launch(executable_path=CHROMIUM, headless=True)
                    try:
                        page = await browser.new_page()
                        await page.goto(f"http://127.0.0.1:{meta.dashboard.port}/dashboard"
                                        f"#token={os.environ['PDMESH_ADMIN_TOKEN']}")
                        await page.wait_for_selector(".heatmap td.cell", timeout=HANG_GUARD_MS)
                        await check_heat_map(page)
                        counts[0][1] = 50                     # the next heartbeat: a new hottest cell
                        await stub.Heartbeat(heartbeat(counts))
                        hottest = '.heatmap td.cell[data-layer="0"][data-expert="1"]'
                        await page.wait_for_function(f"document.querySelector('{hottest}').dataset.tokens === '50'",
                                                     timeout=HANG_GUARD_MS)
                        assert await background(page, hottest) == HOT
                        assert await background(page, '.heatmap td.cell[data-layer="2"][data-expert="5"]') != HOT
                    finally:
                        await browser.close()
        finally:
            await meta.stop(0)
            await meta.close_extras()

    async def check_heat_map(page):
        maps = await page.eval_on_selector_all(".heatmap", "ms => ms.map(m => m.dataset.nodeId)")
        assert maps == ["moe-0"], "a heat map for the MoE node, none for the dense one"
        cells = await page.eval_on_selector_all(
            '.heatmap[data-node-id="moe-0"] td.cell',
            "cs => cs.map(c => [+c.dataset.layer, +c.dataset.expert, +c.dataset.tokens])")
        assert len(cells) == NUM_LAYERS * NUM_EXPERTS
        assert cells == [[i, e, counts[i][e]] for i in range(NUM_LAYERS) for e in range(NUM_EXPERTS)]
        assert await background(page, '.heatmap td.cell[data-layer="2"][data-expert="5"]') == HOT
        assert await background(page, '.heatmap td.cell[data-layer="3"][data-expert="0"]') == COLD

    asyncio.run(main())


async def background(page, selector: str) -> str:
    return await page.eval_on_selector(selector, "c => getComputedStyle(c).backgroundColor")
