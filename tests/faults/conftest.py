"""The fault matrix's meshes (real processes on 127.0.0.1, Mooncake over TCP, fault
injection armed: services/node/fault_injection.py) and its table: every case adds a row;
at the end the table is printed and written to $PDMESH_FAULTS_JSON (bench/faults.py sets
it to bench/results/faults.json), else to the session's temp folder."""
from __future__ import annotations

import json
import os
import platform
import time

import grpc
import pytest

from protos.pdmesh.v1 import meta_pb2, meta_pb2_grpc
from services.cli.launcher import MeshProcesses
from tests.faults.workload import ENGINE, Workload
from tests.integration.conftest import engine_stats, launch, mesh_dict
from tests.channels import operator_channel_sync

TTL_S = 2.0
TIMEOUTS = {"transfer_s": 1.0, "cancel_ack_s": 3.0, "prefill_s": 5.0, "request_s": 80.0, "progress_s": 1.0}
ROWS: list[dict] = []


@pytest.fixture(scope="module")
def fault_mesh(tmp_path_factory):
    """fault_mesh(model_dir, nodes, top) -> MeshProcesses, fault injection armed; every
    mesh is stopped at the end of the test module (the rest of the suite does not share
    the machine with it)."""
    started: list[MeshProcesses] = []

    def start(model_dir, nodes, top=None, **meta) -> MeshProcesses:
        raw = mesh_dict(model_dir, nodes, "mooncake", {"engine": dict(ENGINE), "timeouts": TIMEOUTS, **(top or {})},
                        ttl_seconds=TTL_S, **meta)
        mesh = launch(tmp_path_factory.mktemp("fault-mesh"), raw, env={"PDMESH_FAULT_INJECTION": "1"})
        started.append(mesh)
        return mesh

    yield start
    for mesh in started:
        mesh.stop()


@pytest.fixture(scope="session")
def fault_table():
    return ROWS


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def offline(model, llm_factory):
    """The offline engine every workload's expected tokens come from (the session's
    cached one: the leak check after each test covers it)."""
    return llm_factory(model, **ENGINE)


@pytest.fixture
def work(offline, request):
    """This case's 32 requests and their offline tokens: prompts of its own, salted by the
    test's name, so no earlier case sent any of their blocks (tests/faults/workload.py)."""
    return Workload(offline, salt=request.node.name)


def members(mesh) -> set[str]:
    try:
        with operator_channel_sync(mesh.meta_address) as ch:
            nodes = meta_pb2_grpc.MetaServerStub(ch).ListMembers(meta_pb2.ListMembersRequest(), timeout=2).nodes
    except grpc.RpcError:
        return set()
    return {n.node_id for n in nodes}


def wait_members(mesh, timeout_s: float = 30.0) -> float:
    """Seconds until every engine node of the mesh is a member (AssertionError past timeout_s)."""
    want = {n.node_id for n in mesh.mesh.nodes}
    start = time.monotonic()
    while not want <= members(mesh):
        assert time.monotonic() - start < timeout_s, f"members {members(mesh)}, want {want}"
        time.sleep(0.05)
    return time.monotonic() - start


def busiest_decode(mesh) -> str:
    """The decode node serving the most requests now."""
    decodes = [s for s in mesh.services.values() if s.role == "decode"]
    return max(decodes, key=lambda s: engine_stats(s.address, "decode").running).name


def restart_exited(mesh, env_by_name: dict[str, dict] | None = None) -> None:
    """Start again every service whose process ended; wait until the mesh is whole."""
    for name, svc in mesh.services.items():
        if svc.process is not None and svc.process.poll() is not None:
            mesh.restart(name, env=(env_by_name or {}).get(name))
    wait_members(mesh)


def pytest_terminal_summary(terminalreporter):
    if not ROWS:
        return
    header = f"{'case':<40} {'completed':>9} {'migrated':>8} {'failed':>6} {'max extra latency':>18}"
    lines = [header, "-" * len(header)]
    standard = {"case", "requests", "completed", "migrated", "migrations", "failed", "max_extra_latency_s"}
    for r in ROWS:
        notes = ", ".join(f"{k} {v}" for k, v in r.items() if k not in standard)
        lines.append(f"{r['case']:<40} {r['completed']:>6}/{r['requests']:<2} {r['migrated']:>8} "
                     f"{r['failed']:>6} {r['max_extra_latency_s']:>16.2f} s  {notes}")
    terminalreporter.write_sep("=", "fault matrix")
    for line in lines:
        terminalreporter.write_line(line)
    path = os.environ.get("PDMESH_FAULTS_JSON") or str(terminalreporter.config._tmp_path_factory.getbasetemp()
                                                        / "faults.json")
    with open(path, "w") as f:
        json.dump({"command": "python bench/faults.py", "machine": f"{platform.machine()}, "
                   f"{os.cpu_count()} cores", "rows": ROWS}, f, indent=2)
    terminalreporter.write_line(f"written to {path}")
