"""MetaAdmin on a real mesh of processes (2 prefill + 2 decode, Mooncake over TCP, TTL 2 s),
membership by the embedded registry and by a real etcd:
listing, the `pdmesh admin` CLI, cache-aware routing onto a shared prefix, drain/undrain
with a request in flight, and kill -9 of a decode node while requests keep coming.

The tests share one mesh per registry and pass in any order: each sets the policy it needs
and puts the previous one back, undrains what it drained and restarts what it killed;
routed counts are compared before and after, never read as totals."""
from __future__ import annotations

import asyncio
import contextlib
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
# Bound of every wait below: it only catches a hang (a loaded machine is slower, never this
# slow); what the waits measure is printed, not asserted.
HANG_GUARD_S = 60.0
RESTART_S = 120.0      # a node's process start (torch import, model load) on a loaded machine


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


ALL_UP = {node_id: "up" for _, node_id in NODES}


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


def wait_until(predicate, what: str) -> float:
    """Seconds until predicate() holds (printed); fails only past HANG_GUARD_S."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < HANG_GUARD_S, f"hung waiting for {what}"
        time.sleep(0.05)
    took = time.monotonic() - start
    print(f"{what}: {took:.2f}s")
    return took


@contextlib.contextmanager
def policy(admin, name: str):
    """The routing policy `name` while the block runs, then the one in force before."""
    previous = admin.GetPolicy(meta_pb2.GetPolicyRequest(), timeout=5).policy
    admin.SetPolicy(meta_pb2.SetPolicyRequest(policy=name), timeout=5)
    try:
        yield
    finally:
        admin.SetPolicy(meta_pb2.SetPolicyRequest(policy=previous), timeout=5)


def test_all_nodes_listed_right_after_start(mesh, admin):
    """start() returns once every node is registered: all four are listed up, in role
    order, with what they reported; seconds_since_heartbeat follows their reports."""
    nodes = admin.ListNodes(meta_pb2.ListNodesRequest(), timeout=5).nodes
    assert [(n.info.role, n.info.node_id, n.state) for n in nodes] == [(r, i, "up") for r, i in NODES]
    for n in nodes:
        assert n.info.address == mesh.services[n.info.node_id].address
        assert n.info.load.total_blocks == 512 and n.info.model_id.startswith("tiny-llama")
    last = {n.info.node_id: n.seconds_since_heartbeat for n in nodes}
    print(f"seconds since heartbeat: {last}")
    reported_again: set[str] = set()

    def every_node_reported_again() -> bool:   # its seconds_since_heartbeat dropped
        for n in admin.ListNodes(meta_pb2.ListNodesRequest(), timeout=5).nodes:
            assert n.seconds_since_heartbeat >= 0, n
            if n.seconds_since_heartbeat < last[n.info.node_id]:
                reported_again.add(n.info.node_id)
            last[n.info.node_id] = n.seconds_since_heartbeat
        return reported_again == set(last)
    wait_until(every_node_reported_again, "a fresh heartbeat from every node")


def test_cli_prints_a_table_and_json(mesh, admin):
    def cli(*argv):
        return subprocess.run([sys.executable, "-m", "services.cli", "admin", *argv, "--meta", mesh.meta_address],
                              cwd=ROOT, capture_output=True, text=True, timeout=60)
    with policy(admin, "least_load"):
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
    with policy(admin, "cache_aware"):
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


LONG_TOKENS = 1500   # the request in flight: it outlasts the six short ones many times over


def test_drain_lets_in_flight_finish_and_sends_new_requests_elsewhere(mesh, admin):
    async def scenario():
        before = routed(admin)
        long = asyncio.create_task(stream(mesh.gateway_address, request(prompt(307, 40), max_tokens=LONG_TOKENS)))
        deadline = time.monotonic() + HANG_GUARD_S
        while (now := routed(admin)) == before:
            assert time.monotonic() < deadline, "the long request was never routed"
            await asyncio.sleep(0.01)
        busy = next(k for k in now if k.startswith("decode") and now[k] != before[k])
        other = ({"decode-0", "decode-1"} - {busy}).pop()
        admin.DrainNode(meta_pb2.DrainNodeRequest(node_id=busy), timeout=5)
        try:
            assert states(admin)[busy] == "draining"
            while engine_stats(mesh.services[busy].address, "decode").running != 1:   # prefilled remotely first
                assert time.monotonic() < deadline and not long.done()
                await asyncio.sleep(0.01)
            mid = routed(admin)
            shorts = await asyncio.gather(*(stream(mesh.gateway_address, request(prompt(300 + s, 30), max_tokens=4))
                                            for s in range(6)))
            after = routed(admin)
            assert after[busy] == mid[busy] and after[other] == mid[other] + 6
            assert all(len(tokens) == 4 for tokens, _, _ in shorts)
            # by order, not time: the short ones all finished while the long one still ran there
            assert engine_stats(mesh.services[busy].address, "decode").running == 1
            tokens, _, msgs = await long
            assert len(tokens) == LONG_TOKENS and msgs[-1].finish_reason == "length"
        finally:
            admin.UndrainNode(meta_pb2.UndrainNodeRequest(node_id=busy), timeout=5)
        assert states(admin)[busy] == "up"
        for s in range(4):
            await stream(mesh.gateway_address, request(prompt(300 + s, 30), max_tokens=2))
        final = routed(admin)
        assert final[busy] == after[busy] + 2 and final[other] == after[other] + 2

    with policy(admin, "round_robin"):
        asyncio.run(scenario())


def restore(mesh, admin, name: str) -> None:
    """Start the killed node again; return once every node is listed up and `name` served
    a request by itself (round_robin in force: it gets every other turn)."""
    if mesh.services[name].process.poll() is not None:
        mesh.restart(name, timeout_s=RESTART_S)
    wait_until(lambda: states(admin) == ALL_UP, f"{name} listed up again")
    decodes = [node_id for role, node_id in NODES if role == "decode" and node_id != name]
    served_alone = []   # not retried on another decode node

    def serves() -> bool:
        before = routed(admin)
        generate(mesh, prompt(400 + len(served_alone), 20), max_tokens=2)
        now = routed(admin)
        served_alone.append(now[name] == before[name] + 1 and all(now[k] == before[k] for k in decodes))
        return served_alone[-1]
    wait_until(serves, f"{name} serving again")


def test_killed_decode_node_goes_down_and_requests_complete_elsewhere(mesh, admin):
    """kill -9 of decode-0 while requests keep coming: its TTL lapses and it is listed
    down; the requests routed to it before that complete on decode-1, and none is routed
    to it after. decode-0 is started again at the end, for the other tests."""
    async def watch_until_down(killed_at: float) -> float:
        async with operator_channel(mesh.meta_address) as ch:
            stub = meta_pb2_grpc.MetaAdminStub(ch)
            while True:
                nodes = (await stub.ListNodes(meta_pb2.ListNodesRequest(), timeout=5)).nodes
                if {n.info.node_id: n.state for n in nodes}["decode-0"] == "down":
                    return time.monotonic() - killed_at
                assert time.monotonic() - killed_at < HANG_GUARD_S, "decode-0 never listed down"
                await asyncio.sleep(0.05)

    async def scenario(n: int = 10, every_s: float = 0.25):
        mesh.kill("decode-0")
        watcher = asyncio.create_task(watch_until_down(time.monotonic()))
        tasks = []
        for s in range(n):
            tasks.append(asyncio.create_task(stream(mesh.gateway_address, request(prompt(100 + s, 50), max_tokens=6))))
            await asyncio.sleep(every_s)
        return await asyncio.gather(*tasks), await watcher

    with policy(admin, "round_robin"):   # the dead node gets turns
        try:
            before = routed(admin)
            results, down_in_s = asyncio.run(scenario())
            print(f"decode-0 listed down {down_in_s:.2f}s after its kill -9 (ttl {TTL}s)")
            assert all(len(tokens) == 6 and msgs[-1].finish_reason == "length" for tokens, _, msgs in results)
            down_after = routed(admin)
            assert down_after["decode-0"] > before["decode-0"]         # routed there before it expired ...
            assert down_after["decode-1"] - before["decode-1"] == 10    # ... yet all completed on decode-1
            for s in range(4):
                generate(mesh, prompt(200 + s, 50), max_tokens=3)
            now = routed(admin)
            assert now["decode-0"] == down_after["decode-0"] and now["decode-1"] == down_after["decode-1"] + 4
            assert states(admin) == {**ALL_UP, "decode-0": "down"}
        finally:
            restore(mesh, admin, "decode-0")
