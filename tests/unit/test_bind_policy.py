"""Plaintext only on the loopback (services/security/bind_policy.py): which hosts are
loopback, the one-line refusal (address, risk, the fields that fix it), and each place it
is enforced: grpc_util.bind (nothing bound), the meta-server's dashboard, the `grpc`
transfer receiver, `pdmesh up` before anything starts, and `pdmesh serve` as a process
(exit 2 on 0.0.0.0 without TLS; serving with security.allow_plaintext)."""
from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.config import MetaConfig, SecurityConfig, TransferConfig, mesh_config_from_dict
from services.cli import main
from services.node import grpc_util
from services.security.bind_policy import PlaintextBindError, check_bind, check_mesh_binds, is_loopback
from services.security.credentials import MeshCredentials, tls_files

ROOT = Path(__file__).resolve().parents[2]
SECRET = b"s" * 32
HANG_GUARD_S = 60   # only catches a hang

LOOPBACK = ["127.0.0.1", "127.5.6.7", "::1", "[::1]", "localhost", "LocalHost", " 127.0.0.1 ", "::ffff:127.0.0.1"]
NOT_LOOPBACK = ["0.0.0.0", "::", "[::]", "", "10.0.0.5", "192.168.1.20", "fd00::7", "[fe80::1]", "meta-server",
                "localhost.example.com", "mesh.example", "128.0.0.1", "::ffff:10.0.0.5"]


@pytest.mark.parametrize("host", LOOPBACK)
def test_loopback_hosts_need_nothing(host):
    assert is_loopback(host)
    check_bind(host, 50051, tls=False, allow_plaintext=False)


@pytest.mark.parametrize("host", NOT_LOOPBACK)
def test_other_hosts_need_tls_or_allow_plaintext(host):
    assert not is_loopback(host)
    with pytest.raises(PlaintextBindError) as refused:
        check_bind(host, 50071, tls=False, allow_plaintext=False, service="decode-0")
    message = str(refused.value)
    assert "\n" not in message and message.startswith("decode-0: refusing to serve plaintext on ")
    where = f"[{host.strip('[]')}]:50071" if ":" in host else f"{host or '*'}:50071"
    assert f" {where}, which is not a loopback address" in message
    for words in ("anyone who can reach that address", "API keys", "security.tls_dir", "$PDMESH_TLS_DIR",
                  "`pdmesh certs init`", "security.allow_plaintext: true"):
        assert words in message
    check_bind(host, 50071, tls=True, allow_plaintext=False)
    check_bind(host, 50071, tls=False, allow_plaintext=True)


def test_allow_plaintext_is_a_bool_of_the_security_section():
    assert SecurityConfig().allow_plaintext is False
    mesh = mesh_config_from_dict({"model": "m", "security": {"allow_plaintext": True}})
    assert mesh.security.allow_plaintext is True
    with pytest.raises(ValueError, match="security.allow_plaintext must be true or false, got 'yes'"):
        mesh_config_from_dict({"model": "m", "security": {"allow_plaintext": "yes"}})


def _mesh(host: str = "127.0.0.1", **security):
    return mesh_config_from_dict({
        "model": "m", "meta_server": {"host": "127.0.0.1", "port": 50051}, "gateway": {"host": "127.0.0.1"},
        "kv_store": {"host": "127.0.0.1"}, "security": security,
        "nodes": [{"role": "prefill", "node_id": "p0"}, {"role": "decode", "node_id": "d0", "host": host,
                                                          "port": 50071}]})


def test_a_mesh_config_is_checked_service_by_service():
    check_mesh_binds(_mesh(), environ={})
    check_mesh_binds(mesh_config_from_dict(yaml.safe_load((ROOT / "deploy" / "local.yaml").read_text())), environ={})
    with pytest.raises(PlaintextBindError, match=r"^d0: refusing to serve plaintext on 0\.0\.0\.0:50071"):
        check_mesh_binds(_mesh("0.0.0.0"), environ={})
    check_mesh_binds(_mesh("0.0.0.0"), environ={"PDMESH_TLS_DIR": "/certs"})
    check_mesh_binds(_mesh("0.0.0.0", tls_dir="/certs"), environ={})
    check_mesh_binds(_mesh("0.0.0.0", allow_plaintext=True), environ={})
    grpc_transfer = dataclasses.replace(_mesh(), transfer=TransferConfig(backend="grpc", hostname=""),
                                        nodes=(dataclasses.replace(_mesh().nodes[0], advertise_host="prefill"),))
    with pytest.raises(PlaintextBindError, match=r"^p0 transfer \(grpc backend\): .* prefill:0"):
        check_mesh_binds(grpc_transfer, environ={})
    # the dashboard is plain HTTP carrying the admin token, whatever TLS the gRPC ports have
    exposed = dataclasses.replace(_mesh(tls_dir="/certs"), meta=MetaConfig(host="0.0.0.0", dashboard_port=8088))
    with pytest.raises(PlaintextBindError, match=r"^meta-server dashboard: .* 0\.0\.0\.0:8088") as refused:
        check_mesh_binds(exposed, environ={})
    assert "plain HTTP even with TLS on" in str(refused.value) and "Turn TLS on" not in str(refused.value)
    assert "set its port to 0 (off)" in str(refused.value)


def test_grpc_util_bind_refuses_before_binding_anything():
    async def scenario():
        port = grpc_util.free_port()
        server = grpc_util.new_server(MeshCredentials(cluster_secret=SECRET))
        with pytest.raises(PlaintextBindError, match=f"0.0.0.0:{port}"):
            grpc_util.bind(server, "0.0.0.0", port)
        assert not grpc_util.port_in_use("0.0.0.0", port)
        assert grpc_util.bind(server, "127.0.0.1", 0) > 0
        allowed = grpc_util.new_server(MeshCredentials(cluster_secret=SECRET, allow_plaintext=True))
        assert grpc_util.bind(allowed, "0.0.0.0", 0) > 0
        for s in (server, allowed):
            await s.stop(None)
    asyncio.run(scenario())


def test_grpc_util_bind_with_tls_may_bind_any_address(tmp_path):
    from services.security.certs import init_certs
    init_certs(tmp_path / "tls", ["node-a"])

    async def scenario():
        server = grpc_util.new_server(MeshCredentials(tls=tls_files(str(tmp_path / "tls"), "node-a")))
        assert grpc_util.bind(server, "0.0.0.0", 0) > 0
        await server.stop(None)
    asyncio.run(scenario())


def test_the_meta_servers_dashboard_is_refused_off_the_loopback_before_anything_starts():
    from services.meta_server.server import create_server
    cfg = MetaConfig(host="0.0.0.0", port=0, dashboard_port=grpc_util.free_port())
    with pytest.raises(PlaintextBindError, match="meta-server dashboard"):
        asyncio.run(create_server(cfg, credentials=MeshCredentials(cluster_secret=SECRET, allow_plaintext=False)))


def test_the_grpc_transfer_receiver_is_refused_off_the_loopback():
    from services.node.engine_node import transfer_options
    mesh = dataclasses.replace(_mesh(), transfer=TransferConfig(backend="grpc", hostname="10.1.2.3"))
    with pytest.raises(PlaintextBindError, match=r"^transfer \(grpc backend\): .* 10\.1\.2\.3:0"):
        transfer_options(mesh, "10.1.2.3")
    allowed = dataclasses.replace(mesh, security=SecurityConfig(allow_plaintext=True))
    assert transfer_options(allowed, "10.1.2.3")["host"] == "10.1.2.3"


def test_up_refuses_before_starting_anything(tmp_path, capsys):
    config = tmp_path / "mesh.yaml"
    config.write_text(yaml.safe_dump({"model": str(tmp_path / "no-model"), "gateway": {"host": "0.0.0.0"},
                                      "nodes": [{"role": "both", "node_id": "n0"}]}))
    assert main(["up", "--config", str(config), "--log-dir", str(tmp_path / "logs")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: gateway: refusing to serve plaintext on 0.0.0.0:50050") and err.count("\n") == 1
    assert not (tmp_path / "logs").exists() and not (tmp_path / "no-model").exists()


# --- `pdmesh serve` as a process -------------------------------------------------------

def _serve_meta(tmp_path: Path, allow_plaintext: bool) -> tuple[subprocess.Popen, int]:
    port = grpc_util.free_port("0.0.0.0")
    config = tmp_path / f"mesh-{allow_plaintext}.yaml"
    raw = {"model": "m", "meta_server": {"host": "0.0.0.0", "port": port}}
    if allow_plaintext:   # else the default, as a config that never heard of it says
        raw["security"] = {"allow_plaintext": True}
    config.write_text(yaml.safe_dump(raw))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "meta-server", "--config", str(config)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, port


def test_serve_on_any_address_without_tls_exits_2_naming_the_risk(tmp_path):
    proc, port = _serve_meta(tmp_path, allow_plaintext=False)
    try:
        out, _ = proc.communicate(timeout=HANG_GUARD_S)
    finally:
        if proc.poll() is None:   # it served: no refusal
            proc.kill()
            proc.wait()
    assert proc.returncode == 2, out
    [line] = [line for line in out.splitlines() if line.startswith("error:")]
    assert line.startswith(f"error: meta-server: refusing to serve plaintext on 0.0.0.0:{port}")
    assert "security.allow_plaintext: true" in line and "anyone who can reach that address" in line
    assert not grpc_util.port_in_use("0.0.0.0", port)


def test_serve_on_any_address_with_allow_plaintext_serves(tmp_path):
    proc, port = _serve_meta(tmp_path, allow_plaintext=True)
    try:
        deadline = time.monotonic() + HANG_GUARD_S
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            while True:
                assert proc.poll() is None, proc.stdout.read()
                try:
                    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
                    assert reply.status == health_pb2.HealthCheckResponse.SERVING
                    break
                except grpc.RpcError:
                    assert time.monotonic() < deadline, "never served"
                    time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=HANG_GUARD_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
