"""`pdmesh certs init` and services/security/certs.py: the files and their modes, each
cert's CN / SANs / extended key usages and its signature by the mesh CA, the refusal to
replace a CA, names and hosts from a mesh config; then the certs on a real grpc.aio
server: mTLS (what auth_context shows of a peer), no client cert, a foreign CA, a
hostname outside the SANs, and what require_client_auth=False does."""
from __future__ import annotations

import asyncio
import ipaddress
import os
import stat
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.config import mesh_config_from_dict
from services.cli import main
from services.security.certs import hosts_of, init_certs, service_names

NAMES = ["gateway", "node-a"]
HOSTS = ["10.0.0.5", "Mesh.Example", "0.0.0.0", "[fd00::7]"]
EXPECTED_SANS = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                 x509.IPAddress(ipaddress.ip_address("::1")), x509.IPAddress(ipaddress.ip_address("10.0.0.5")),
                 x509.DNSName("mesh.example"), x509.IPAddress(ipaddress.ip_address("fd00::7"))]
EXPECTED_FILES = ["gateway.crt", "gateway.key", "node-a.crt", "node-a.key", "admin.crt", "admin.key",
                  "ca.crt", "ca.key"]

MESH = {
    "model": "m", "cluster": "prod",
    "meta_server": {"host": "0.0.0.0", "advertise_host": "meta.mesh", "standbys": 2},
    "gateway": {"host": "10.0.0.1", "meta_addresses": ["meta.mesh:50051", "[fd00::1]:50052"]},
    "kv_store": {"host": "127.0.0.1", "advertise_host": "kv.mesh"},
    "nodes": [{"role": "prefill", "node_id": "p0", "host": "::", "advertise_host": "10.0.0.2"},
              {"role": "decode", "node_id": "d0", "host": "10.0.0.3"}],
}


@pytest.fixture(scope="module")
def certs_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("certs") / "tls"
    written = init_certs(out, NAMES, HOSTS, days=30, cluster="test")
    assert list(written) == EXPECTED_FILES
    assert written == {name: out / name for name in EXPECTED_FILES}
    return out


@pytest.fixture(scope="module")
def other_ca_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("other") / "tls"
    init_certs(out, ["node-a"], HOSTS, cluster="test")     # the same names, other keys
    return out


def load(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def eku(cert: x509.Certificate) -> list:
    return list(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)


def cn(cert: x509.Certificate) -> str:
    return cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value


def test_files_and_modes(certs_dir):
    assert mode(certs_dir) == 0o700
    assert sorted(p.name for p in certs_dir.iterdir()) == sorted(EXPECTED_FILES)   # no temp files left
    for name in EXPECTED_FILES:
        assert mode(certs_dir / name) == (0o600 if name.endswith(".key") else 0o644), name


def test_key_is_0600_under_an_open_umask(tmp_path):
    old = os.umask(0)
    try:
        init_certs(tmp_path / "tls", [])
    finally:
        os.umask(old)
    assert sorted(p.name for p in (tmp_path / "tls").iterdir()) == [
        "admin.crt", "admin.key", "ca.crt", "ca.key", "service.crt", "service.key"]
    assert mode(tmp_path / "tls") == 0o700
    assert [mode(tmp_path / "tls" / f) for f in ("service.key", "admin.key", "ca.key")] == [0o600] * 3
    assert cn(load(tmp_path / "tls" / "service.crt")) == "service:service"


def test_ca_cert(certs_dir):
    ca = load(certs_dir / "ca.crt")
    assert cn(ca) == "pdmesh mesh CA test"
    assert ca.issuer == ca.subject
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is True
    usage = ca.extensions.get_extension_for_class(x509.KeyUsage).value
    assert usage.key_cert_sign and usage.crl_sign
    ca.verify_directly_issued_by(ca)


@pytest.mark.parametrize("name", NAMES)
def test_service_cert(certs_dir, name):
    cert, ca = load(certs_dir / f"{name}.crt"), load(certs_dir / "ca.crt")
    assert cn(cert) == f"service:{name}"
    assert list(cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value) == EXPECTED_SANS
    assert eku(cert) == [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    assert (cert.not_valid_after_utc - cert.not_valid_before_utc).days == 30   # 30 days + 5 min of skew
    cert.verify_directly_issued_by(ca)


def test_admin_cert(certs_dir):
    cert = load(certs_dir / "admin.crt")
    assert cn(cert) == "admin:operator"
    assert eku(cert) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    with pytest.raises(x509.ExtensionNotFound):
        cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    cert.verify_directly_issued_by(load(certs_dir / "ca.crt"))


def test_foreign_ca_does_not_verify(certs_dir, other_ca_dir):
    assert load(other_ca_dir / "ca.crt").subject == load(certs_dir / "ca.crt").subject
    with pytest.raises(InvalidSignature):
        load(other_ca_dir / "node-a.crt").verify_directly_issued_by(load(certs_dir / "ca.crt"))


def test_refuses_to_replace_a_ca_without_force(tmp_path):
    out = tmp_path / "tls"
    init_certs(out, ["gateway"])
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(FileExistsError):
        init_certs(out, ["gateway", "d0"])
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    init_certs(out, ["gateway"], force=True)
    after = {p.name: p.read_bytes() for p in out.iterdir()}
    assert sorted(after) == sorted(before)
    assert all(after[name] != before[name] for name in before)


@pytest.mark.parametrize("kwargs", [
    {"names": ["ca"]}, {"names": ["admin"]}, {"names": ["../x"]}, {"names": ["a b"]},
    {"names": ["a"], "hosts": ["bad host"]}, {"names": ["a"], "days": 0},
])
def test_bad_arguments(tmp_path, kwargs):
    with pytest.raises(ValueError):
        init_certs(tmp_path / "tls", **kwargs)
    assert not (tmp_path / "tls").exists()


def test_names_and_hosts_of_a_mesh_config():
    mesh = mesh_config_from_dict(MESH)
    assert service_names(mesh) == ["meta-server", "meta-server-1", "meta-server-2", "gateway", "kv-store",
                                   "p0", "d0"]
    assert hosts_of(mesh) == ["meta.mesh", "10.0.0.1", "fd00::1", "127.0.0.1", "kv.mesh", "10.0.0.2",
                              "10.0.0.3"]
    bare = mesh_config_from_dict({"model": "m"})
    assert service_names(bare) == ["meta-server", "gateway"]
    assert hosts_of(bare) == ["127.0.0.1"]


# -- on a real gRPC server ---------------------------------------------------------------

class _RecordingHealth(health.HealthServicer):
    def __init__(self):
        super().__init__()
        self.auth_contexts: list[dict] = []

    def Check(self, request, context):
        self.auth_contexts.append(context.auth_context())
        return super().Check(request, context)


def _read(path: Path) -> bytes:
    return path.read_bytes()


def _client(ca_dir: Path, pair_dir: Path | None = None, name: str = "") -> grpc.ChannelCredentials:
    if pair_dir is None:
        return grpc.ssl_channel_credentials(_read(ca_dir / "ca.crt"))
    return grpc.ssl_channel_credentials(_read(ca_dir / "ca.crt"), _read(pair_dir / f"{name}.key"),
                                        _read(pair_dir / f"{name}.crt"))


def check_over_tls(certs_dir: Path, require_client_auth: bool, clients: list[tuple]) -> list:
    """Serve grpc health with gateway.crt on 127.0.0.1:0; for each (credentials, channel
    options) call Check once. Returns per client (status code name, auth_context or None)."""
    async def scenario():
        server = grpc.aio.server()
        servicer = _RecordingHealth()
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        creds = grpc.ssl_server_credentials(
            [(_read(certs_dir / "gateway.key"), _read(certs_dir / "gateway.crt"))],
            root_certificates=_read(certs_dir / "ca.crt"), require_client_auth=require_client_auth)
        port = server.add_secure_port("127.0.0.1:0", creds)
        await server.start()
        results = []
        try:
            for creds, options in clients:
                servicer.auth_contexts.clear()
                async with grpc.aio.secure_channel(f"127.0.0.1:{port}", creds, options=options) as channel:
                    try:
                        reply = await health_pb2_grpc.HealthStub(channel).Check(
                            health_pb2.HealthCheckRequest(), timeout=5)
                        assert reply.status == health_pb2.HealthCheckResponse.SERVING
                        results.append(("OK", servicer.auth_contexts[0]))
                    except grpc.aio.AioRpcError as e:
                        results.append((e.code().name, None))
        finally:
            await server.stop(None)
        return results
    return asyncio.run(scenario())


def test_mtls_end_to_end(certs_dir, other_ca_dir):
    results = check_over_tls(certs_dir, True, [
        (_client(certs_dir, certs_dir, "node-a"), None),
        (_client(certs_dir, certs_dir, "admin"), None),
        (_client(certs_dir), None),                               # no client cert
        (_client(certs_dir, other_ca_dir, "node-a"), None),       # a cert from another CA
        (_client(other_ca_dir, certs_dir, "node-a"), None),       # trusts another CA only
        (_client(certs_dir, certs_dir, "node-a"), (("grpc.ssl_target_name_override", "mesh.example"),)),
        (_client(certs_dir, certs_dir, "node-a"), (("grpc.ssl_target_name_override", "wrong.example"),)),
    ])
    assert [code for code, _ in results] == ["OK", "OK", "UNAVAILABLE", "UNAVAILABLE", "UNAVAILABLE", "OK",
                                             "UNAVAILABLE"]
    service, admin = results[0][1], results[1][1]
    assert service["transport_security_type"] == [b"ssl"]
    assert service["x509_common_name"] == [b"service:node-a"]
    assert service["x509_subject"] == [b"CN=service:node-a,O=pdmesh"]
    assert service["x509_subject_alternative_name"] == [b"localhost", b"127.0.0.1", b"::1", b"10.0.0.5",
                                                        b"mesh.example", b"fd00::7"]
    assert service["x509_pem_cert"] == [_read(certs_dir / "node-a.crt")]
    assert admin["x509_common_name"] == [b"admin:operator"]
    assert "x509_subject_alternative_name" not in admin


def test_tls_without_required_client_auth_never_asks_for_a_client_cert(certs_dir, other_ca_dir):
    """require_client_auth=False with root certificates does not request a client cert at
    all: every client connects, and auth_context carries no peer identity even when the
    client has a valid cert."""
    results = check_over_tls(certs_dir, False, [
        (_client(certs_dir, certs_dir, "node-a"), None),
        (_client(certs_dir), None),
        (_client(certs_dir, other_ca_dir, "node-a"), None),
    ])
    assert [code for code, _ in results] == ["OK", "OK", "OK"]
    for _, auth in results:
        assert auth["transport_security_type"] == [b"ssl"]
        assert "x509_common_name" not in auth and "x509_pem_cert" not in auth


# -- the CLI ------------------------------------------------------------------------------

def test_cli_init_from_config(tmp_path, capsys):
    import yaml
    config = tmp_path / "mesh.yaml"
    config.write_text(yaml.safe_dump(MESH))
    out = tmp_path / "tls"
    assert main(["certs", "init", str(out), "--config", str(config), "--hosts", "10.9.9.9,gw.example"]) == 0
    names = ["meta-server", "meta-server-1", "meta-server-2", "gateway", "kv-store", "p0", "d0"]
    files = [f"{n}.{ext}" for n in [*names, "admin", "ca"] for ext in ("crt", "key")]
    lines = capsys.readouterr().out.splitlines()
    assert lines[:-2] == [f"wrote {out / f}" for f in files]
    assert lines[-2].startswith(f"mesh CA: {out / 'ca.crt'}")
    assert lines[-1].startswith(f"keep {out / 'ca.key'} off the mesh's machines")
    assert cn(load(out / "ca.crt")) == "pdmesh mesh CA prod"
    sans = load(out / "p0.crt").extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["localhost", "gw.example", "meta.mesh", "kv.mesh"]
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == [
        "127.0.0.1", "::1", "10.9.9.9", "10.0.0.1", "fd00::1", "10.0.0.2", "10.0.0.3"]

    assert main(["certs", "init", str(out), "--names", "x"]) == 2
    assert "ca.key exists" in capsys.readouterr().err and not (out / "x.crt").exists()
    assert main(["certs", "init", str(out), "--config", str(config), "--names", "x,y", "--force"]) == 0
    assert cn(load(out / "y.crt")) == "service:y"
    assert cn(load(out / "ca.crt")) == "pdmesh mesh CA prod"


def test_cli_errors(tmp_path, capsys):
    assert main(["certs", "init", str(tmp_path / "a"), "--config", str(tmp_path / "missing.yaml")]) == 2
    assert main(["certs", "init", str(tmp_path / "b"), "--names", "ca"]) == 2
    assert main(["certs", "init", str(tmp_path / "c"), "--days", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("pdmesh certs init: error:") == 3 and "days must be" in err
    assert not any((tmp_path / d).exists() for d in "abc")
