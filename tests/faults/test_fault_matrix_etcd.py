"""The fault matrix's etcd cases (see test_fault_matrix.py for what every case asserts).
Mesh B: etcd (membership and election), meta-server leader + one standby, prefill-0,
decode-0; the 32 requests are in flight when the fault hits."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from tests.etcd_server import EtcdServer
from tests.faults.conftest import restart_exited, wait_members
from tests.faults.test_fault_matrix import STOP_S, finish, mid_stream, until
from tests.faults.workload import Workload
from tests.integration.test_etcd_mesh import leads

MESH_B = (("prefill", "prefill-0"), ("decode", "decode-0"))
META_SERVERS = ("meta-server", "meta-server-1")
WAITED = "waiting up to"      # the gateway's log line of a request that found no decode node
LEADER_WAIT_S = 30.0   # the election lease is half the TTL (2 s); past this no meta-server leads: a hang


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    with EtcdServer(tmp_path_factory.mktemp("etcd")) as server:
        yield server


@pytest.fixture(scope="module")
def mesh_b(model, etcd, fault_mesh):   # etcd set up first, so torn down after the mesh
    return fault_mesh(model, MESH_B, {"etcd_endpoint": etcd.endpoint, "cluster": "faults"}, standbys=1)


@pytest.fixture(scope="module")
def baseline_b(mesh_b, offline, fault_table):
    work = Workload(offline, salt="baseline, mesh B")
    outcomes, _ = asyncio.run(work.run(mesh_b.gateway_address))
    fault_table.append(work.row("none (baseline, etcd)", outcomes, outcomes))
    return outcomes


def leader(mesh) -> str:
    """The meta-server that leads now (whichever: an earlier case may have moved it)."""
    deadline = time.monotonic() + LEADER_WAIT_S
    while True:
        for name in META_SERVERS:
            svc = mesh.services[name]
            if svc.process.poll() is None and leads(svc.address):
                return name
        assert time.monotonic() < deadline, "no meta-server leads"
        time.sleep(0.05)


@pytest.mark.long_fault
def test_etcd_stopped_for_10s(mesh_b, etcd, work, baseline_b, fault_table):
    async def fault(progress):
        await until(lambda: mid_stream(progress))
        open_streams = progress.num_open
        await asyncio.to_thread(etcd.stop)
        try:
            await asyncio.sleep(STOP_S)
        finally:
            await asyncio.to_thread(etcd.start)
        return open_streams

    outcomes, open_streams = asyncio.run(work.run(mesh_b.gateway_address, fault))
    row = finish(mesh_b, work, fault_table, "etcd stopped 10 s", outcomes, baseline_b)
    row["open_streams_at_stop"] = open_streams
    assert open_streams >= 1, "etcd stopped while requests streamed"
    wait_members(mesh_b)


def test_meta_server_leader_killed(mesh_b, work, baseline_b, fault_table):
    killed = leader(mesh_b)
    standby = next(name for name in META_SERVERS if name != killed)

    async def fault(progress):
        await until(lambda: mid_stream(progress))
        mesh_b.kill(killed)

    try:
        outcomes, _ = asyncio.run(work.run(mesh_b.gateway_address, fault))
        mesh_b.meta_address = mesh_b.services[standby].address   # the standby leads now
        finish(mesh_b, work, fault_table, "meta-server leader kill -9 (etcd, standby)", outcomes, baseline_b)
        assert leader(mesh_b) == standby
        # the new leader routes: a request sent now is served with its tokens
        after = asyncio.run(work.run_one(mesh_b.gateway_address, 0))
        assert (after.error, after.tokens) == (None, work.expected[0]), after.details
    finally:
        restart_exited(mesh_b)          # the killed one comes back as the standby


def test_the_only_decode_node_killed_then_restarted(mesh_b, work, baseline_b, fault_table):
    """With no decode node left the requests wait for one (timeouts.node_wait_s) instead of
    failing: the node, restarted while they wait, is routed to once it joins (the streams
    it served migrate onto it, the ones not yet started start there) and every request
    completes with the offline tokens. How long the mesh had no decode node is in the table."""
    async def fault(progress):
        await until(lambda: mid_stream(progress))
        killed = time.monotonic()
        try:
            mesh_b.kill("decode-0")
        finally:                       # whatever happens, the module's later cases have a decode node
            await asyncio.to_thread(restart_exited, mesh_b)
        await asyncio.to_thread(wait_members, mesh_b)
        return time.monotonic() - killed

    gateway_log = mesh_b.services["gateway"].log_path
    logged_before = gateway_log.read_text().count(WAITED)
    outcomes, without_node_s = asyncio.run(work.run(mesh_b.gateway_address, fault))
    row = finish(mesh_b, work, fault_table, "only decode node kill -9, restarted", outcomes, baseline_b)
    assert row["migrated"] >= 1, "the streams it served moved onto the restarted node"
    row["waited_for_a_node"] = gateway_log.read_text().count(WAITED) - logged_before
    assert row["waited_for_a_node"] >= 1, "the gateway waited for a decode node"
    row["without_a_decode_node_s"] = round(without_node_s, 2)


@pytest.mark.long_fault
def test_the_only_decode_node_stopped_for_10s(mesh_b, work, baseline_b, fault_table):
    """The only decode node SIGSTOP'd for 10 s mid-stream: its streams go silent, it leaves
    the members after a TTL, the requests (their deadline outlasts the pause) wait for a
    decode node, and when it resumes and registers again every stream moves back onto it
    and completes with the offline tokens."""
    async def fault(progress):
        await until(lambda: mid_stream(progress))
        os.killpg(mesh_b.services["decode-0"].process.pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(STOP_S)
        finally:
            os.killpg(mesh_b.services["decode-0"].process.pid, signal.SIGCONT)

    gateway_log = mesh_b.services["gateway"].log_path
    logged_before = gateway_log.read_text().count(WAITED)
    outcomes, _ = asyncio.run(work.run(mesh_b.gateway_address, fault))
    row = finish(mesh_b, work, fault_table, "only decode node SIGSTOP 10 s", outcomes, baseline_b)
    row["waited_for_a_node"] = gateway_log.read_text().count(WAITED) - logged_before
    assert row["waited_for_a_node"] >= 1, "the gateway waited for a decode node"
    wait_members(mesh_b)
