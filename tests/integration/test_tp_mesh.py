"""A tensor-parallel node in a real mesh (issue 16): `both` node n0 at TP 2 (nodes[].engine)
beside n1 at TP 1. n0's engine steps with a rank-1 worker process (the path ran: the
process exists and n0 was routed to); every request gets exactly the offline TP-1
engine's tokens; kill -9 of the worker takes n0 out of the mesh (it leaves by itself, not by
a lapsed TTL) and the mesh keeps serving on n1; once the mesh stops no rank process is left.
The tests that kill or stop a node do it on a mesh of their own."""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from pathlib import Path

import pytest

from protos.pdmesh.v1 import meta_pb2, meta_pb2_grpc
from tests.channels import operator_channel_sync
from tests.integration.conftest import launch, mesh_dict
from tests.integration.test_mesh import MAX_TOKENS, assert_matches_offline, assert_no_blocks_in_use, run_concurrently
from tests.integration.test_mesh import expected  # noqa: F401  (the offline engine's tokens: a fixture)

NODES = (("both", "n0"), ("both", "n1"))
# Bound of the waits below: it only catches a hang (a loaded machine is slower, never this
# slow); the seconds taken are printed, not asserted.
HANG_GUARD_S = 60.0


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama")


def launch_tp_mesh(model, tmp_path_factory, name: str, nodes=NODES):
    """A mesh of `nodes` (round_robin) whose first node runs at TP 2."""
    raw = mesh_dict(model, nodes, policy="round_robin")
    raw["nodes"][0]["engine"] = {"tensor_parallel_size": 2}
    return launch(tmp_path_factory.mktemp(name), raw)


@pytest.fixture(scope="module")
def mesh(model, tmp_path_factory):
    m = launch_tp_mesh(model, tmp_path_factory, "tp-mesh")
    yield m
    m.stop()


def children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def rank_workers(pid: int) -> list[int]:
    """The tensor-parallel worker processes of an engine node's process."""
    found = []
    for child in children(pid):
        try:
            comm = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"multiprocessing" in comm and b"resource_tracker" not in comm:
            found.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def members(mesh) -> dict[str, object]:
    with operator_channel_sync(mesh.meta_address) as ch:
        reply = meta_pb2_grpc.MetaServerStub(ch).ListMembers(meta_pb2.ListMembersRequest(), timeout=5)
    return {n.node_id: n for n in reply.nodes}


def routed(mesh) -> dict[str, int]:
    """Requests routed to each node so far (0 for never)."""
    with mesh.admin_channel() as ch:
        stats = meta_pb2_grpc.MetaAdminStub(ch).GetStats(meta_pb2.GetStatsRequest(), timeout=5)
    return {node_id: 0 for _, node_id in NODES} | {n.node_id: n.num_routed for n in stats.nodes}


def listed_states(mesh) -> dict[str, str]:
    """Every node the meta-server lists, down ones included, by state."""
    with mesh.admin_channel() as ch:
        nodes = meta_pb2_grpc.MetaAdminStub(ch).ListNodes(meta_pb2.ListNodesRequest(), timeout=5).nodes
    return {n.info.node_id: n.state for n in nodes}


def test_a_tp2_node_serves_the_offline_tokens(mesh, expected):  # noqa: F811
    workers = rank_workers(mesh.services["n0"].process.pid)
    assert len(workers) == 1, "n0 steps with one rank-1 worker process"
    assert not rank_workers(mesh.services["n1"].process.pid), "n1 is TP 1"
    assert members(mesh)["n0"].tensor_parallel_size == 2
    before = routed(mesh)
    results = asyncio.run(run_concurrently(mesh.gateway_address))
    assert_matches_offline(results, expected)
    counts = {k: v - before[k] for k, v in routed(mesh).items()}
    assert counts["n0"] >= len(MAX_TOKENS) // 2 - 1 and counts["n1"] >= 1, counts
    assert_no_blocks_in_use(mesh, timeout_s=HANG_GUARD_S)


def listening_sockets(pid: int) -> dict[int, str]:
    """TCP port -> the address process `pid` listens on there (its socket fds, matched in
    /proc/PID/net/tcp{,6})."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = {}
    for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]:
            p = line.split()
            if p[3] == "0A" and p[9] in inodes:   # LISTEN
                addr, port = p[1].split(":")
                raw = bytes.fromhex(addr)
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                found[int(port, 16)] = socket.inet_ntop(family, raw)
    return found


def test_node_info_lists_every_ranks_transfer_listeners(mesh):
    """The worker's Mooncake engine opens listeners of its own (bound to the wildcard, and
    filtered to the configured host): NodeInfo must say what they admit, as it does for
    rank 0's, for the firewall rules and `pdmesh admin nodes`."""
    [worker] = rank_workers(mesh.services["n0"].process.pid)
    info = members(mesh)["n0"]
    [_, worker_rank] = info.kv_ranks
    assert worker_rank.listen_addresses and set(worker_rank.listen_addresses) <= set(info.transfer_listen_addresses)
    listed = {int(a.rpartition(":")[2]) for a in info.transfer_listen_addresses}
    sockets = listening_sockets(worker)
    assert {int(a.rpartition(":")[2]) for a in worker_rank.listen_addresses} <= set(sockets)
    # the others are gloo's pair listeners, on loopback
    assert all(addr == "127.0.0.1" for port, addr in sockets.items() if port not in listed), sockets
    assert all(addr in ("0.0.0.0", "::") for port, addr in sockets.items() if port in listed), sockets
    assert all(not a.startswith(("0.0.0.0", "[::]")) for a in info.transfer_listen_addresses)


def test_kill_9_of_a_rank_takes_the_node_out_and_the_mesh_serves_on(model, tmp_path_factory, expected):  # noqa: F811
    """n0 leaves the mesh by itself: it is not listed at all, where a node whose TTL lapsed
    is listed down; every request after that goes to n1."""
    m = launch_tp_mesh(model, tmp_path_factory, "tp-mesh-kill")
    try:
        n0 = m.services["n0"].process
        [worker] = rank_workers(n0.pid)
        os.kill(worker, signal.SIGKILL)
        killed = time.monotonic()
        while "n0" in members(m):
            assert time.monotonic() - killed < HANG_GUARD_S, "n0 never left the mesh after its rank died"
            time.sleep(0.05)
        print(f"n0 left the mesh {time.monotonic() - killed:.2f}s after its rank died")
        assert listed_states(m) == {"n1": "up"}
        n0.wait(timeout=HANG_GUARD_S)          # it exits non-zero for its supervisor to restart it
        assert n0.returncode == 1
        before = routed(m)
        results = asyncio.run(run_concurrently(m.gateway_address))
        assert_matches_offline(results, expected)
        after = routed(m)
        assert after["n0"] == before["n0"] and after["n1"] == before["n1"] + len(MAX_TOKENS), (before, after)
        assert_no_blocks_in_use(m, timeout_s=HANG_GUARD_S)
    finally:
        m.stop()


def test_no_rank_process_outlives_the_mesh(model, tmp_path_factory):
    m = launch_tp_mesh(model, tmp_path_factory, "tp-mesh-stop", nodes=(("both", "n0"),))
    try:
        [worker] = rank_workers(m.services["n0"].process.pid)
    finally:
        m.stop()
    stopped = time.monotonic()
    while alive(worker):
        assert time.monotonic() - stopped < HANG_GUARD_S, "the rank-1 worker outlived its node"
        time.sleep(0.05)
    print(f"the rank-1 worker was gone {time.monotonic() - stopped:.2f}s after the mesh stopped")
