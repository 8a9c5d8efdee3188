"""MetaAdmin on a real mesh of processes (2 prefill + 2 decode, Mooncake over TCP, TTL 2 s),
membership by the embedded registry and by a real etcd:
listing, the `pdmesh admin` CLI, cache-aware routing onto a shared prefix, drain/undrain
with a request in flight, and kill -9 of a decode node while requests keep coming."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import pytest

from protos.pdmesh.v1 import meta_pb2, meta_pb2_grpc
from services.cli.launcher import ROOT
from tests.integration.conftest import engine_stats
from tests.integration.test_mesh import request, stream
from tests.channels import operator_channel, operator_channel_sync

NODES = [("prefill", "prefill-0"), ("prefill", "prefill-1"), ("decode", "decode-0"), ("decode", "decode-1")]
TTL = 2.0


@pytest.fixture(scope="module", params=["embedded", "etcd"])
def mesh(request, tiny_model, start_mesh, tmp_path_factory):
    """The same tests with the embedded registry and with membership in a real etcd."""
    if request.param == "embedded":
        mesh = start_mesh(tiny_model("llama"), nodes=NODES, ttl_seconds=TTL)
        yield mesh
        mesh.stop()
        return
    from tests.etcd_server import EtcdServer
    with EtcdServer(tmp_path_factory.mktemp("etcd")) as etcd:
        mesh = start_mesh(tiny_model("llama"), nodes=NODES, ttl_seconds=TTL,
                          top={"etcd_endpoint": etcd.endpoint, "cluster": "admin"})
        yield mesh
        mesh.stop()


@pytest.fixture(scope="module")
def admin(mesh):
    with operator_channel_sync(mesh.meta_address) as ch:
        yield meta_pb2_grpc.MetaAdminStub(ch)


def states(admin) -> dict[str, str]:
    return {n.info.node_id: n.state for n in admin.ListNodes(meta_pb2.ListNodesRequest(), timeout=5).nodes}


def routed(admin) -> dict[str, int]:
    """Requests routed to each node so far (0 for never)."""
    counts = {node_id: 0 for _, node_id in NODES}
    counts.update((n.node_id, n.num_routed) for n in admin.GetStats(meta_pb2.GetStatsRequest(), timeout=5).nodes)
    return counts


def generate(mesh, ids, max_tokens=8) -> list[int]:
    tokens, _, msgs = asyncio.run(stream(mesh.gateway_address, request(ids, max_tokens=max_tokens)))
    assert msgs[-1].finish_reason == "length" and len(tokens) == max_tokens
    return tokens


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 1000 + 3 for i in range(n)]


def test_all_nodes_listed_right_after_start(mesh, admin):
    deadline = time.monotonic() + 1.0
    while set(states(admin).values()) != {"up"} or len(states(admin)) != 4:
        assert time.monotonic() < deadline, states(admin)
        time.sleep(0.05)
    nodes = admin.ListNodes(meta_pb2.ListNodesRequest(), timeout=5).nodes
    assert [(n.info.role, n.info.node_id) for n in nodes] == NODES
    for n in nodes:
        assert n.info.address == mesh.services[n.info.node_id].address
        assert n.info.load.total_blocks == 512 and n.info.model_id.startswith("tiny-llama")
        assert n.seconds_since_heartbeat < TTL, (n.info.node_id, n.seconds_since_heartbeat)


def test_cli_prints_a_table_and_json(mesh):
    def cli(*argv):
        return subprocess.run([sys.executable, "-m", "services.cli", "admin", *argv, "--meta", mesh.meta_address],
                              cwd=ROOT, capture_output=True, text=True, timeout=60)
    out = cli("nodes")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split()[:4] == ["NODE", "ROLE", "STATE", "ADDRESS"]
    assert [line.split()[:3] for line in lines[1:]] == [[node_id, role, "up"] for role, node_id in NODES]
    stats = json.loads(cli("stats", "--json").stdout)
    assert stats["total_blocks"] == 4 * 512 and stats["policy"] == "least_load"
    bad = cli("drain", "decode-9")
    assert bad.returncode == 1 and "NOT_FOUND" in bad.stderr


def test_cache_aware_sends_a_shared_prefix_to_the_node_that_holds_it(mesh, admin):
    admin.SetPolicy(meta_pb2.SetPolicyRequest(policy="cache_aware"), timeout=5)
    try:
        prefix = prompt(1, 512)
        before = routed(admin)
        generate(mesh, prefix + prompt(2, 88))
        first = {k: v - before[k] for k, v in routed(admin).items() if v != before[k]}
        assert sorted(first.values()) == [1, 1], first
        prefill = next(k for k in first if k.startswith("prefill"))
        hits = engine_stats(mesh.services[prefill].address, "prefill").prefix_hit_tokens
        for suffix in (3, 4, 5):
            mid = routed(admin)
            generate(mesh, prefix + prompt(suffix, 88))
            now = routed(admin)
            assert {k for k in now if now[k] != mid[k]} == set(first)
        gained = engine_stats(mesh.services[prefill].address, "prefill").prefix_hit_tokens - hits
        assert gained >= 3 * 512
    finally:
        admin.SetPolicy(meta_pb2.SetPolicyRequest(policy="least_load"), timeout=5)


def test_drain_lets_in_flight_finish_and_sends_new_requests_elsewhere(mesh, admin):
    admin.SetPolicy(meta_pb2.SetPolicyRequest(policy="round_robin"), timeout=5)

    async def scenario():
        before = routed(admin)
        long = asyncio.create_task(stream(mesh.gateway_address, request(prompt(7, 40), max_tokens=400)))
        while (now := routed(admin)) == before:
            await asyncio.sleep(0.01)
        busy = next(k for k in now if k.startswith("decode") and now[k] != before[k])
        other = ({"decode-0", "decode-1"} - {busy}).pop()
        admin.DrainNode(meta_pb2.DrainNodeRequest(node_id=busy), timeout=5)
        assert states(admin)[busy] == "draining"
        deadline = time.monotonic() + 10       # routed; now prefilled remotely, then decoding
        while engine_stats(mesh.services[busy].address, "decode").running != 1:
            assert time.monotonic() < deadline and not long.done()
            await asyncio.sleep(0.01)
        mid = routed(admin)
        shorts = await asyncio.gather(*(stream(mesh.gateway_address, request(prompt(s, 30), max_tokens=4))
                                        for s in range(6)))
        after = routed(admin)
        assert after[busy] == mid[busy] and after[other] == mid[other] + 6
        assert all(len(tokens) == 4 for tokens, _, _ in shorts)
        assert engine_stats(mesh.services[busy].address, "decode").running == 1
        tokens, _, msgs = await long
        assert len(tokens) == 400 and msgs[-1].finish_reason == "length"
        admin.UndrainNode(meta_pb2.UndrainNodeRequest(node_id=busy), timeout=5)
        assert states(admin)[busy] == "up"
        for s in range(4):
            await stream(mesh.gateway_address, request(prompt(s, 30), max_tokens=2))
        final = routed(admin)
        assert final[busy] == after[busy] + 2 and final[other] == after[other] + 2

    try:
        asyncio.run(scenario())
    finally:
        admin.SetPolicy(meta_pb2.SetPolicyRequest(policy="least_load"), timeout=5)


def test_killed_decode_node_is_down_within_ttl_and_requests_complete_elsewhere(mesh, admin):
    admin.SetPolicy(meta_pb2.SetPolicyRequest(policy="round_robin"), timeout=5)   # the dead node gets turns
    before = routed(admin)

    async def watch_until_down(killed_at: float) -> float:
        async with operator_channel(mesh.meta_address) as ch:
            stub = meta_pb2_grpc.MetaAdminStub(ch)
            while True:
                nodes = (await stub.ListNodes(meta_pb2.ListNodesRequest(), timeout=5)).nodes
                if {n.info.node_id: n.state for n in nodes}["decode-0"] == "down":
                    return time.monotonic() - killed_at
                await asyncio.sleep(0.05)

    async def scenario(n: int = 10, every_s: float = 0.25):
        mesh.kill("decode-0")
        watcher = asyncio.create_task(watch_until_down(time.monotonic()))
        tasks = []
        for s in range(n):
            tasks.append(asyncio.create_task(stream(mesh.gateway_address, request(prompt(100 + s, 50), max_tokens=6))))
            await asyncio.sleep(every_s)
        return await asyncio.gather(*tasks), await watcher

    results, down_in_s = asyncio.run(scenario())
    assert down_in_s < TTL + 1.0
    assert all(len(tokens) == 6 and msgs[-1].finish_reason == "length" for tokens, _, msgs in results)
    down_after = routed(admin)
    assert down_after["decode-0"] > before["decode-0"]         # routed there before it expired ...
    assert down_after["decode-1"] - before["decode-1"] == 10    # ... yet all completed on decode-1
    for s in range(4):
        generate(mesh, prompt(200 + s, 50), max_tokens=3)
    now = routed(admin)
    assert now["decode-0"] == down_after["decode-0"] and now["decode-1"] == down_after["decode-1"] + 4
    assert states(admin) == {"prefill-0": "up", "prefill-1": "up", "decode-0": "down", "decode-1": "up"}
