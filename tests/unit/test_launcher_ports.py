"""A taken port is an error, never a silently shared one: gRPC servers bind without
SO_REUSEPORT, and the launcher refuses to start when a fixed port is in use (a stranger
there would answer its health checks); a port it planned is planned for one service only,
and a service is healthy only when its own process answers there."""
from __future__ import annotations

import asyncio
import socket
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2_grpc

from common.config import mesh_config_from_dict
from protos.pdmesh.v1 import meta_pb2, meta_pb2_grpc
from services.node import grpc_util
from services.cli.launcher import MeshProcesses


def test_second_grpc_server_on_a_port_fails_to_bind():
    async def main():
        first, second = grpc_util.new_server(), grpc_util.new_server()
        port = grpc_util.bind(first, "127.0.0.1", 0)
        await first.start()
        try:
            with pytest.raises(RuntimeError, match=f"127.0.0.1:{port}"):
                grpc_util.bind(second, "127.0.0.1", port)
        finally:
            await first.stop(None)
    asyncio.run(main())


def test_launcher_refuses_a_taken_fixed_port(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        raw = {"model": "m", "meta_server": {"port": 0}, "gateway": {"port": port},
               "nodes": [{"role": "both", "node_id": "n0", "port": 0}]}
        mesh = MeshProcesses(str(tmp_path / "mesh.yaml"), mesh_config_from_dict(raw), tmp_path, quiet=True)
        with pytest.raises(RuntimeError, match=f"gateway 127.0.0.1:{port}"):
            mesh.start(timeout_s=5)
        assert mesh.services == {}
    assert not grpc_util.port_in_use("127.0.0.1", port)


def test_no_port_is_planned_for_two_services(tmp_path, monkeypatch):
    """free_port releases the port it found, so two calls may return one port (CI: a
    prefill node planned on a port another service of its mesh bound first; that
    service's SERVING was taken for the node's, which never registered). A port
    already planned, or fixed in the config (the gateway's HTTP port), is passed over;
    so is one planned for a service not started yet when a retry asks for a new one."""
    from services.cli import launcher
    answers = iter([41000, 41000, 41002, 41004, 41000, 41004, 41006, 41006, 41008, 41008, 41000, 41010])
    monkeypatch.setattr(launcher, "free_port", lambda host: next(answers))
    raw = {"model": "m", "meta_server": {"port": 0}, "gateway": {"port": 0, "http_port": 41002},
           "nodes": [{"role": "prefill", "node_id": "p0"}, {"role": "decode", "node_id": "d0"}]}
    mesh = MeshProcesses(str(tmp_path / "mesh.yaml"), mesh_config_from_dict(raw), tmp_path, quiet=True)
    mesh._plan()
    assert {name: svc.port for name, svc in mesh.services.items()} == {
        "meta-server": 41000, "p0": 41004, "d0": 41006, "gateway": 41008}
    assert mesh._new_port("127.0.0.1") == 41010     # a retry's port: the gateway's and the meta-server's passed over


def _health_server(ports: list[int]) -> grpc.Server:
    """Another service's gRPC server (as a sibling's bound on a port planned twice):
    SERVING on every port it listens on."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=[("grpc.so_reuseport", 0)])
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    ports += [server.add_insecure_port("127.0.0.1:0") for _ in range(2)]
    server.start()
    return server


def test_planned_ports_taken_before_the_services_bind_them_are_replaced(tmp_path, tiny_model, monkeypatch):
    """free_port's answer is free only until another process binds it (the ranks' gloo and
    the transfer engines bind ephemeral ports, another service of the mesh its own): each
    service whose planned port was taken (the meta-server's by a plain listener, the
    node's and the gateway's by a gRPC server answering health checks SERVING; all three
    in one start) exits with the bind status and the launcher starts it again on another
    port; the stranger's SERVING is never taken for the service's. The mesh comes up with
    the node registered at its new address."""
    from services.cli import launcher
    real, calls, ports = launcher.free_port, [], []
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports.append(taken.getsockname()[1])

        def planned(host):          # the meta-server's port, the node's, the gateway's: each taken
            calls.append(host)
            return ports[len(calls) - 1] if len(calls) <= 3 else real(host)
        monkeypatch.setattr(launcher, "free_port", planned)
        raw = {"model": str(tiny_model("llama")), "engine": {"num_blocks": 32},
               "meta_server": {"port": 0, "ttl_seconds": 2.0}, "gateway": {"port": 0},
               "nodes": [{"role": "both", "node_id": "n0"}]}
        mesh = MeshProcesses(str(tmp_path / "mesh.yaml"), mesh_config_from_dict(raw), tmp_path / "logs", quiet=True)
        (tmp_path / "mesh.yaml").write_text(__import__("yaml").safe_dump(raw))
        stranger = _health_server(ports)
        try:
            mesh.start(timeout_s=120)
            for service, port in zip(("meta-server", "n0", "gateway"), ports):
                svc = mesh.services[service]
                assert svc.port != port and grpc_util.port_in_use("127.0.0.1", svc.port)
                assert f"cannot bind 127.0.0.1:{port} (address in use?)" in svc.log_path.read_text(), service
            assert mesh.meta_address == mesh.services["meta-server"].address
            with mesh.admin_channel() as channel:
                nodes = meta_pb2_grpc.MetaAdminStub(channel).ListNodes(meta_pb2.ListNodesRequest(), timeout=10).nodes
            assert {n.info.node_id: n.info.address for n in nodes} == {"n0": mesh.services["n0"].address}
        finally:
            mesh.stop()
            stranger.stop(None)
