"""A taken port is an error, never a silently shared one: gRPC servers bind without
SO_REUSEPORT, and the launcher refuses to start when a fixed port is in use (a stranger
there would answer its health checks)."""
from __future__ import annotations

import asyncio
import socket

import pytest

from common.config import mesh_config_from_dict
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


def test_planned_ports_taken_before_the_services_bind_them_are_replaced(tmp_path, tiny_model, monkeypatch):
    """free_port's answer is free only until another process binds it (the ranks' gloo and
    the transfer engines bind ephemeral ports): each service whose planned port was taken
    (the meta-server's, the node's, the gateway's: all three in one start) exits with the
    bind status and the launcher starts it again on another port; the mesh comes up."""
    from services.cli import launcher
    real, calls = launcher.free_port, []
    sockets = [socket.socket() for _ in range(3)]
    try:
        for taken in sockets:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
        ports = [taken.getsockname()[1] for taken in sockets]

        def planned(host):          # the meta-server's port, the node's, the gateway's: each taken
            calls.append(host)
            return ports[len(calls) - 1] if len(calls) <= 3 else real(host)
        monkeypatch.setattr(launcher, "free_port", planned)
        raw = {"model": str(tiny_model("llama")), "engine": {"num_blocks": 32},
               "meta_server": {"port": 0, "ttl_seconds": 2.0}, "gateway": {"port": 0},
               "nodes": [{"role": "both", "node_id": "n0"}]}
        mesh = MeshProcesses(str(tmp_path / "mesh.yaml"), mesh_config_from_dict(raw), tmp_path / "logs", quiet=True)
        (tmp_path / "mesh.yaml").write_text(__import__("yaml").safe_dump(raw))
        try:
            mesh.start(timeout_s=120)
            for service, port in zip(("meta-server", "n0", "gateway"), ports):
                svc = mesh.services[service]
                assert svc.port != port and grpc_util.port_in_use("127.0.0.1", svc.port)
                assert f"cannot bind 127.0.0.1:{port} (address in use?)" in svc.log_path.read_text(), service
            assert mesh.meta_address == mesh.services["meta-server"].address
        finally:
            mesh.stop()
    finally:
        for taken in sockets:
            taken.close()
