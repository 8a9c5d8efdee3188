"""A tensor-parallel node in a real mesh (issue 16): `both` node n0 at TP 2 (nodes[].engine)
beside n1 at TP 1. n0's engine steps with a rank-1 worker process (the path ran: the
process exists and n0 was routed to); every request gets exactly the offline TP-1
engine's tokens; kill -9 of the worker takes n0 out of the mesh within 2 s and the mesh
keeps serving on n1; once the mesh stops no rank process is left."""
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
from tests.integration.conftest import launch, mesh_dict, mixed_prompts
from tests.integration.test_mesh import MAX_TOKENS, assert_matches_offline, assert_no_blocks_in_use, run_concurrently
from tests.integration.test_mesh import expected  # noqa: F401  (the offline engine's tokens: a fixture)

NODES = (("both", "n0"), ("both", "n1"))


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def mesh(model, tmp_path_factory):
    raw = mesh_dict(model, NODES, policy="round_robin")
    raw["nodes"][0]["engine"] = {"tensor_parallel_size": 2}
    m = launch(tmp_path_factory.mktemp("tp-mesh"), raw)
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
    with mesh.admin_channel() as ch:
        stats = meta_pb2_grpc.MetaAdminStub(ch).GetStats(meta_pb2.GetStatsRequest(), timeout=5)
    return {n.node_id: n.num_routed for n in stats.nodes}


def test_a_tp2_node_serves_the_offline_tokens(mesh, expected):  # noqa: F811
    workers = rank_workers(mesh.services["n0"].process.pid)
    assert len(workers) == 1, "n0 steps with one rank-1 worker process"
    assert not rank_workers(mesh.services["n1"].process.pid), "n1 is TP 1"
    assert members(mesh)["n0"].tensor_parallel_size == 2
    results = asyncio.run(run_concurrently(mesh.gateway_address))
    assert_matches_offline(results, expected)
    counts = routed(mesh)
    assert counts["n0"] >= len(MAX_TOKENS) // 2 - 1 and counts["n1"] >= 1, counts
    assert_no_blocks_in_use(mesh)


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


def test_kill_9_of_a_rank_takes_the_node_out_and_the_mesh_serves_on(mesh, expected):  # noqa: F811
    n0 = mesh.services["n0"].process
    [worker] = rank_workers(n0.pid)
    os.kill(worker, signal.SIGKILL)
    killed = time.monotonic()
    while "n0" in members(mesh):
        assert time.monotonic() - killed < 2.0, "n0 still a member 2 s after its rank died"
        time.sleep(0.05)
    n0.wait(timeout=10)          # it exits non-zero for its supervisor to restart it
    assert n0.returncode == 1
    results = asyncio.run(run_concurrently(mesh.gateway_address))
    assert_matches_offline(results, expected)
    assert_no_blocks_in_use(mesh)


def test_no_rank_process_outlives_the_mesh(model, tmp_path_factory):
    raw = mesh_dict(model, (("both", "n0"),))
    raw["nodes"][0]["engine"] = {"tensor_parallel_size": 2}
    m = launch(tmp_path_factory.mktemp("tp-mesh-stop"), raw)
    try:
        [worker] = rank_workers(m.services["n0"].process.pid)
    finally:
        m.stop()
    deadline = time.monotonic() + 10
    while alive(worker):
        assert time.monotonic() < deadline, "the rank-1 worker outlived its node"
        time.sleep(0.05)
