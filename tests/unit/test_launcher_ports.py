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


@pytest.mark.parametrize("service,call", [("meta-server", 1), ("n0", 2), ("gateway", 3)])
def test_a_planned_port_taken_before_the_service_binds_it_is_replaced(tmp_path, tiny_model, monkeypatch, service,
                                                                     call):
    """free_port's answer is free only until another process binds it (the ranks' gloo and
    the transfer engines bind ephemeral ports): the service exits with the bind status and
    the launcher starts it again on another port; the mesh comes up."""
    from services.cli import launcher
    real, calls = launcher.free_port, []
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]

        def planned(host):          # the meta-server's port, the node's, the gateway's: one taken
            calls.append(host)
            return port if len(calls) == call else real(host)
        monkeypatch.setattr(launcher, "free_port", planned)
        raw = {"model": str(tiny_model("llama")), "engine": {"num_blocks": 32},
               "meta_server": {"port": 0, "ttl_seconds": 2.0}, "gateway": {"port": 0},
               "nodes": [{"role": "both", "node_id": "n0"}]}
        mesh = MeshProcesses(str(tmp_path / "mesh.yaml"), mesh_config_from_dict(raw), tmp_path / "logs", quiet=True)
        (tmp_path / "mesh.yaml").write_text(__import__("yaml").safe_dump(raw))
        try:
            mesh.start(timeout_s=120)
            svc = mesh.services[service]
            assert svc.port != port and grpc_util.port_in_use("127.0.0.1", svc.port)
            assert f"cannot bind 127.0.0.1:{port} (address in use?)" in svc.log_path.read_text()
            if service == "meta-server":
                assert mesh.meta_address == svc.address
        finally:
            mesh.stop()
