"""The meta-server's KV-memory dashboard in a real browser (Debian's chromium driven by
Playwright) against a real mesh (1 prefill + 2 decode, TTL 2 s): the page lists every
node, the decode tier's used-block bars grow while long requests run and go back to
zero after, a drained node shows as draining; `pdmesh top --once` shows the nodes.
Skips only when chromium is not installed (`make sysdeps` installs it)."""
from __future__ import annotations

import asyncio
import os
import random
import shutil
import subprocess
import sys
import threading
import time

import pytest

from protos.pdmesh.v1 import meta_pb2, meta_pb2_grpc
from services.cli.launcher import ROOT
from tests.channels import operator_channel_sync
from tests.integration.test_mesh import request, stream
from tests.server_process import free_port

CHROMIUM = shutil.which("chromium")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (make sysdeps)")
NODES = [("prefill", "prefill-0"), ("decode", "decode-0"), ("decode", "decode-1")]
NODE_IDS = [node_id for _, node_id in NODES]
HANG_GUARD_S = 60.0   # only catches a hang: the page refreshes every second, a loaded machine is slower


@pytest.fixture(scope="module")
def mesh(tiny_model, start_mesh):
    port = free_port()
    mesh = start_mesh(tiny_model("llama"), nodes=NODES, ttl_seconds=2.0, dashboard_port=port)
    mesh.dashboard_url = f"http://127.0.0.1:{port}"
    yield mesh
    mesh.stop()


@pytest.fixture(scope="module")
def page(mesh):
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True)
        page = browser.new_page()
        sent = []
        page.on("request", lambda r: sent.append(r.url))
        page.goto(f"{mesh.dashboard_url}/dashboard#token={os.environ['PDMESH_ADMIN_TOKEN']}")
        page.wait_for_function("document.body.dataset.updated !== undefined")
        assert "token" not in page.url, "the token left the address bar"
        assert not any(os.environ["PDMESH_ADMIN_TOKEN"] in u for u in sent), "the token is in no URL sent"
        yield page
        browser.close()


def rows(page) -> dict[str, dict[str, str]]:
    """node_id -> the row's data attributes (state, used, cached, free, quarantined, total)."""
    return page.eval_on_selector_all("tr.node", "rs => Object.fromEntries(rs.map(r => [r.dataset.nodeId, "
                                                 "Object.assign({}, r.dataset)]))")


def wait_for(page, predicate, what: str, timeout_s: float = HANG_GUARD_S):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        seen = rows(page)
        if predicate(seen):
            return seen
        time.sleep(0.1)
    raise AssertionError(f"{what}: last seen {seen}")


def decode_used(seen) -> int:
    return sum(int(seen[n]["used"]) for n in ("decode-0", "decode-1") if n in seen)


def all_up(seen) -> bool:
    return {n: seen.get(n, {}).get("state") for n in NODE_IDS} == dict.fromkeys(NODE_IDS, "up")


def test_page_lists_every_node(page):
    # every node up: a node another test drained and undrained may show draining for a refresh
    seen = wait_for(page, lambda s: sorted(s) == sorted(NODE_IDS) and all_up(s), "every node listed, up")
    assert {seen[n]["role"] for n in NODE_IDS} == {"prefill", "decode"}
    for n in NODE_IDS:
        r = seen[n]
        assert int(r["total"]) == 512
        assert sum(int(r[k]) for k in ("used", "quarantined", "cached", "free")) == 512
    # the bar's segments carry the same numbers
    widths = page.eval_on_selector_all('tr.node[data-node-id="decode-0"] .seg',
                                       "ss => ss.map(s => [s.dataset.segment, s.dataset.blocks])")
    assert [k for k, _ in widths] == ["used", "quarantined", "cached", "free"]


def test_used_bar_grows_while_requests_run_then_returns_to_zero(page, mesh):
    """Long requests (1700 tokens each: far longer than a page refresh, so the page always
    sees them running) fill the decode bars; cancelled once seen, their blocks come back."""
    wait_for(page, lambda s: len(s) == 3 and decode_used(s) == 0, "idle before")
    rng = random.Random(3)
    reqs = [request([rng.randrange(1, 1000) for _ in range(300)], max_tokens=1700) for _ in range(4)]
    loop = asyncio.new_event_loop()
    sender = threading.Thread(target=loop.run_forever, name="dashboard requests")
    sender.start()
    streams = [asyncio.run_coroutine_threadsafe(stream(mesh.gateway_address, r), loop) for r in reqs]
    try:
        busy = wait_for(page, lambda s: decode_used(s) >= 4 * 19, "used blocks grow while requests run")
        assert not any(f.done() for f in streams), "the page saw them while they ran"
    finally:
        for f in streams:
            f.cancel()

        async def settle():   # every cancelled stream closed its channel before the loop ends
            await asyncio.gather(*(t for t in asyncio.all_tasks() if t is not asyncio.current_task()),
                                 return_exceptions=True)
        asyncio.run_coroutine_threadsafe(settle(), loop).result(HANG_GUARD_S)
        loop.call_soon_threadsafe(loop.stop)
        sender.join(HANG_GUARD_S)
        loop.close()
    assert sum(int(busy[n]["free"]) + int(busy[n]["cached"]) for n in ("decode-0", "decode-1")) < 2 * 512
    after = wait_for(page, lambda s: all(int(s[n]["used"]) == 0 and int(s[n]["quarantined"]) == 0
                                         for n in NODE_IDS), "used back to zero")
    # the prompts' full blocks stay as prefix cache
    assert sum(int(after[n]["cached"]) for n in NODE_IDS) > 0


def test_drained_node_shows_draining_and_top_once(page, mesh):
    with operator_channel_sync(mesh.meta_address) as ch:
        admin = meta_pb2_grpc.MetaAdminStub(ch)
        try:
            admin.DrainNode(meta_pb2.DrainNodeRequest(node_id="decode-1"), timeout=5)
            wait_for(page, lambda s: (s.get("decode-1", {}).get("state"), s.get("decode-0", {}).get("state"))
                     == ("draining", "up"), "decode-1 draining, decode-0 up")
            assert page.inner_text('tr.node[data-node-id="decode-1"] td.state') == "draining"
            top = subprocess.run([sys.executable, "-m", "services.cli", "top", "--dashboard", mesh.dashboard_url,
                                  "--once"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                                 env={**os.environ, "COLUMNS": "250"})
            assert top.returncode == 0, top.stderr
            for node_id in NODE_IDS:
                assert node_id in top.stdout
            line = next(l for l in top.stdout.splitlines() if "decode-1" in l)
            assert "draining" in line
        finally:
            admin.UndrainNode(meta_pb2.UndrainNodeRequest(node_id="decode-1"), timeout=5)
