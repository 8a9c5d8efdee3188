"""The fault matrix: each case injects one fault into a serving mesh (real processes,
Mooncake over TCP) while the 32 requests of tests/faults/workload.py stream, then
asserts every request completed with the offline engine's tokens (no case here may fail
one: each fault leaves a node that can serve), none hung, and every live node ends with no
block in use or QUARANTINED and the kv-store with no pin. Each case adds a row to the
table (tests/faults/conftest.py). Cases marked long_fault (a 10 s stop) can be skipped
locally: make test PYTEST_ARGS="-m 'not long_fault'".

Mesh A: meta-server (embedded registry), kv-store, prefill-0, decode-0, decode-1.
Mesh B: etcd, meta-server leader + standby, prefill-0, decode-0.
"""
from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from protos.pdmesh.v1 import meta_pb2, meta_pb2_grpc
from tests.channels import operator_channel_sync
from tests.faults.conftest import busiest_decode, members, restart_exited, wait_members
from tests.integration.conftest import engine_stats
from tests.integration.test_mesh import assert_no_blocks_in_use

MESH_A = (("prefill", "prefill-0"), ("decode", "decode-0"), ("decode", "decode-1"))
KV_STORE = {"kv_store": {"port": 0, "capacity_mb": 64}}
STOP_S = 10.0
# quarantined blocks wait for the prefill node's confirmation (a stopped one: SIGCONT); the
# kv-store pins a stopped prefill node took around its stop may be held until their lease
# ends (timeouts.kv_store_pin_lease_s, 20 s; CI saw 16 pinned at 20 s): longer, with a margin
LEAK_WAIT_S = 30.0


@pytest.fixture(scope="module")
def mesh_a(model, fault_mesh):
    return fault_mesh(model, MESH_A, KV_STORE)


@pytest.fixture(scope="module")
def baseline_a(mesh_a, work, fault_table):
    outcomes, _ = asyncio.run(work.run(mesh_a.gateway_address))
    fault_table.append(work.row("none (baseline)", outcomes, outcomes))
    return outcomes


async def until(predicate, timeout_s: float = 60.0, what: str = "the moment") -> None:
    """Poll predicate (which may make blocking calls: it runs in a thread, off the
    clients' event loop) until true. A predicate with a describe() method says in the
    failure what it saw last."""
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(predicate):
        if time.monotonic() >= deadline:
            seen = await asyncio.to_thread(predicate.describe) if hasattr(predicate, "describe") else ""
            raise AssertionError(f"never reached {what} in {timeout_s:.0f} s{seen}")
        await asyncio.sleep(0.01)


def mid_stream(progress) -> bool:
    """Every request has tokens, and a quarter of all of them have streamed."""
    return min(progress.tokens) > 0 and progress.total >= 32 * 30


def pid(mesh, name: str) -> int:
    return mesh.services[name].process.pid


def kv_remote(mesh) -> int:
    return sum(engine_stats(s.address, "decode").kv_remote for s in mesh.services.values() if s.role == "decode")


class Prefilling:
    """Predicate: the prefill node has started on this case's prompts (it is computing one
    now, or has pushed KV since this was made) and decode nodes still wait on it. The
    prompts repeat from case to case and the decode nodes hold their prefixes, so the
    prefill node's share of a burst is a few tokens each, about 0.2 s in all: "computing
    now" alone may fall between two polls (CI saw a case never reach it once); the bytes
    it pushed only grow. Asked of the prefill node itself: a decode node's kv_remote alone
    may be a request of the case before, still settling on a node that has just come
    back. Keeps what it saw, so a moment never reached says why."""

    def __init__(self, mesh):
        self.mesh = mesh
        self.bytes_at_start = self._prefill_stats().transfer_bytes_written
        self.seen: list[tuple[int, int, int, int]] = []

    def _prefill_stats(self):
        return engine_stats(self.mesh.services["prefill-0"].address, "prefill")

    def __call__(self) -> bool:
        stats = self._prefill_stats()
        pushed = stats.transfer_bytes_written - self.bytes_at_start
        started = stats.running + stats.waiting >= 1 or pushed > 0
        remote = kv_remote(self.mesh) if started else -1
        self.seen.append((stats.running, stats.waiting, pushed, remote))
        return started and remote >= 1

    def describe(self) -> str:
        with operator_channel_sync(self.mesh.meta_address) as ch:
            route = meta_pb2_grpc.MetaAdminStub(ch).GetStats(meta_pb2.GetStatsRequest(), timeout=5)
            nodes = meta_pb2_grpc.MetaServerStub(ch).ListMembers(meta_pb2.ListMembersRequest(), timeout=5).nodes
        started = [s for s in self.seen if s[3] >= 0]
        return (f"; polls {len(self.seen)}, {len(started)} with the prefill node started "
                f"(running, waiting, bytes pushed, decode kv_remote: {started[-3:]}); routed "
                f"{route.num_routed}, prefilled on the decode node {route.num_local_prefill}; "
                "members " + ", ".join(f"{n.node_id}{' (stalled)' if n.load.stalled else ''}" for n in nodes))


def finish(mesh, work, fault_table, case: str, outcomes, baseline, **row_args) -> dict:
    row = work.row(case, outcomes, baseline, **row_args)
    fault_table.append(row)
    assert_no_blocks_in_use(mesh, timeout_s=LEAK_WAIT_S)
    return row


def test_decode_node_killed_mid_stream(mesh_a, work, baseline_a, fault_table):
    async def fault(progress):
        await until(lambda: mid_stream(progress))
        victim = await asyncio.to_thread(busiest_decode, mesh_a)
        mesh_a.kill(victim)
        return victim

    outcomes, victim = asyncio.run(work.run(mesh_a.gateway_address, fault))
    row = finish(mesh_a, work, fault_table, "decode node kill -9 mid-stream", outcomes, baseline_a)
    assert row["migrated"] >= 1, "the dead node's streams moved to the other decode node"
    restart_exited(mesh_a)


def test_decode_step_loop_raises(mesh_a, work, baseline_a, fault_table):
    left: dict[str, float] = {}

    async def fault(progress):
        await until(lambda: mid_stream(progress))
        victim = await asyncio.to_thread(busiest_decode, mesh_a)
        os.kill(pid(mesh_a, victim), signal.SIGUSR1)
        raised = time.monotonic()
        await until(lambda: victim not in members(mesh_a), timeout_s=10, what="the node leaving the mesh")
        left["s"] = time.monotonic() - raised
        return victim

    outcomes, victim = asyncio.run(work.run(mesh_a.gateway_address, fault))
    row = finish(mesh_a, work, fault_table, "decode step loop raises", outcomes, baseline_a)
    assert row["migrated"] >= 1
    row["left_mesh_s"] = round(left["s"], 2)     # the target is 1 s; loose bound for CI
    assert left["s"] < 3.0, f"left the mesh {left['s']:.2f}s after its engine died"
    proc = mesh_a.services[victim].process
    assert proc.wait(timeout=15) == 1, "a node whose engine died exits 1 (for its supervisor)"
    restart_exited(mesh_a)


@pytest.mark.long_fault
def test_decode_node_stopped_for_10s(mesh_a, work, baseline_a, fault_table):
    async def fault(progress):
        await until(lambda: mid_stream(progress))
        victim = await asyncio.to_thread(busiest_decode, mesh_a)
        os.killpg(pid(mesh_a, victim), signal.SIGSTOP)
        await asyncio.sleep(STOP_S)
        os.killpg(pid(mesh_a, victim), signal.SIGCONT)
        return victim

    outcomes, victim = asyncio.run(work.run(mesh_a.gateway_address, fault))
    row = finish(mesh_a, work, fault_table, "decode node SIGSTOP 10 s", outcomes, baseline_a)
    assert row["migrated"] >= 1
    wait_members(mesh_a)


def test_prefill_node_killed_mid_prefill(mesh_a, work, baseline_a, fault_table):
    async def fault(progress):
        watch = Prefilling(mesh_a)
        await until(watch, what="a prompt being prefilled on the prefill node")
        # frozen first, so the moment holds while it is checked: the burst's prompts are
        # prefix hits on the decode nodes, and the prefill node's share of it lasts ~0.2 s
        os.killpg(pid(mesh_a, "prefill-0"), signal.SIGSTOP)
        try:
            await asyncio.sleep(0.1)              # answers already on their way land
            waiting = await asyncio.to_thread(kv_remote, mesh_a)
        finally:
            mesh_a.kill("prefill-0")              # SIGKILL ends a stopped process too
        return f"; decode requests waiting on it when it stopped: {waiting}" + await asyncio.to_thread(watch.describe)

    try:
        outcomes, seen = asyncio.run(work.run(mesh_a.gateway_address, fault))
        finish(mesh_a, work, fault_table, "prefill node kill -9 mid-prefill", outcomes, baseline_a)
        assert any(not o.remote_prefill for o in outcomes), "some prompts were computed on the decode node" + seen
    finally:
        restart_exited(mesh_a)


@pytest.mark.long_fault
def test_prefill_node_stopped_for_10s(mesh_a, work, baseline_a, fault_table):
    async def fault(progress):
        await until(Prefilling(mesh_a), what="a prompt being prefilled on the prefill node")
        os.killpg(pid(mesh_a, "prefill-0"), signal.SIGSTOP)
        await asyncio.sleep(STOP_S)
        os.killpg(pid(mesh_a, "prefill-0"), signal.SIGCONT)

    outcomes, _ = asyncio.run(work.run(mesh_a.gateway_address, fault))
    finish(mesh_a, work, fault_table, "prefill node SIGSTOP 10 s", outcomes, baseline_a)
    wait_members(mesh_a)


def test_transfer_failure_on_a_tenth_of_kv_writes(mesh_a, work, baseline_a, fault_table):
    mesh_a.kill("prefill-0", signal.SIGTERM)
    restart_exited(mesh_a, {"prefill-0": {"PDMESH_FAULT_TRANSFER_FAIL_RATE": "0.1"}})
    try:
        outcomes, _ = asyncio.run(work.run(mesh_a.gateway_address))
        finish(mesh_a, work, fault_table, "10% of KV writes fail", outcomes, baseline_a)
        assert any(not o.remote_prefill for o in outcomes), "a failed push fell back to the decode node"
    finally:
        mesh_a.kill("prefill-0", signal.SIGTERM)
        restart_exited(mesh_a, {"prefill-0": {}})


def test_kv_store_killed(mesh_a, work, baseline_a, fault_table):
    async def fault(progress):
        await until(lambda: progress.total >= 32 * 10)
        mesh_a.kill("kv-store")

    outcomes, _ = asyncio.run(work.run(mesh_a.gateway_address, fault))
    finish(mesh_a, work, fault_table, "kv-store kill -9", outcomes, baseline_a)
    mesh_a.restart("kv-store")


def test_embedded_meta_server_killed_and_restarted(mesh_a, work, baseline_a, fault_table):
    rejoined: dict[str, float] = {}

    async def fault(progress):
        await until(lambda: mid_stream(progress))
        mesh_a.kill("meta-server")
        await asyncio.sleep(1.0)
        await asyncio.to_thread(mesh_a.restart, "meta-server")
        rejoined["s"] = await asyncio.to_thread(wait_members, mesh_a, 10.0)

    outcomes, _ = asyncio.run(work.run(mesh_a.gateway_address, fault))
    row = finish(mesh_a, work, fault_table, "embedded meta-server kill -9, restart", outcomes, baseline_a)
    row["nodes_back_s"] = round(rejoined["s"], 2)    # the target is 2 s; loose bound for CI
    assert rejoined["s"] < 5.0, f"the nodes were back {rejoined['s']:.2f}s after the restart"
