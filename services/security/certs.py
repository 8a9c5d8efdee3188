"""The mesh's TLS files: one CA, a certificate per service, one admin client certificate.

`init_certs(dir, names, hosts)` writes into dir (created 0700):

    NAME.crt, NAME.key   per service: CN `service:NAME`; SANs localhost, 127.0.0.1, ::1 and
                         every host; extendedKeyUsage serverAuth + clientAuth (the same pair
                         serves the service's port and its calls to other services)
    admin.crt, admin.key CN `admin:operator`, clientAuth only (`pdmesh admin`, health checks)
    ca.crt, ca.key       the mesh CA (CA:true, keyCertSign) that signed all of the above;
                         written last, so a ca.key means the set is complete

Every key is EC P-256, PEM PKCS#8, unencrypted, mode 0600. Every file is written atomically
(a temp file beside it, then os.replace); a key file is created 0600, never readable by
others even for a moment. An existing ca.key is replaced only with force=True: a new CA
breaks every certificate the old one signed.

A peer's CN says who it is: the prefix SERVICE_CN_PREFIX marks a mesh service, ADMIN_CN
the operator.
"""
from __future__ import annotations

import datetime
import ipaddress
import os
import re
import secrets
from pathlib import Path
from typing import Iterable, Sequence

SERVICE_CN_PREFIX = "service:"
ADMIN_CN = "admin:operator"
CA_CERT_FILE = "ca.crt"
CA_KEY_FILE = "ca.key"
ADMIN_NAME = "admin"
SHARED_NAME = "service"          # the one service cert when no names are given
DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1")
UNSPECIFIED_HOSTS = ("", "0.0.0.0", "::")

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_RESERVED_NAMES = ("ca", ADMIN_NAME)
_CLOCK_SKEW = datetime.timedelta(minutes=5)


def service_names(mesh_config) -> list[str]:
    """The services of a MeshConfig, one cert each: meta-server (and meta-server-1..K for
    K standbys), gateway, kv-store when configured, then every node_id."""
    names = ["meta-server", *(f"meta-server-{i}" for i in range(1, mesh_config.meta.standbys + 1)), "gateway"]
    if mesh_config.kv_store is not None:
        names.append("kv-store")
    names.extend(n.node_id for n in mesh_config.nodes)
    return list(dict.fromkeys(names))


def hosts_of(mesh_config) -> list[str]:
    """Every host a MeshConfig names for a service (bind and advertise hosts of meta_server,
    gateway, kv_store and nodes, and the hosts of gateway.meta_addresses), in order, without
    duplicates and without the unspecified 0.0.0.0 / ::."""
    hosts = [mesh_config.meta.host, mesh_config.meta.advertise_host, mesh_config.gateway.host]
    hosts.extend(_host_of_address(a) for a in mesh_config.gateway.meta_addresses)
    if mesh_config.kv_store is not None:
        hosts.extend([mesh_config.kv_store.host, mesh_config.kv_store.advertise_host])
    for node in mesh_config.nodes:
        hosts.extend([node.host, node.advertise_host])
    return _unique_hosts(hosts)


def init_certs(dir: str | os.PathLike, names: Sequence[str], hosts: Iterable[str] = (), days: int = 365,
               cluster: str = "", force: bool = False) -> dict[str, Path]:
    """Write a fresh CA and a cert+key per name (no names: one shared SHARED_NAME) plus the
    admin pair into dir. Returns {file name: path} in the order written (ca.key last).

    Raises ValueError for a bad name, host or days; FileExistsError when dir/ca.key exists
    and not force (nothing is written then)."""
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID

    names = list(dict.fromkeys(names)) or [SHARED_NAME]
    for name in names:
        _check_name(name)
    if not isinstance(days, int) or days < 1:
        raise ValueError(f"days must be an integer >= 1, got {days!r}")
    sans = _san_entries(_unique_hosts([*DEFAULT_HOSTS, *hosts]))
    out = Path(dir)
    if (out / CA_KEY_FILE).exists() and not force:
        raise FileExistsError(f"{out / CA_KEY_FILE} exists")
    if not out.is_dir():
        out.mkdir(mode=0o700, parents=True)
        os.chmod(out, 0o700)

    now = datetime.datetime.now(datetime.timezone.utc)
    not_before, not_after = now - _CLOCK_SKEW, now + datetime.timedelta(days=days)
    ca_key = _new_key()
    ca_cert = _ca_cert(ca_key, f"pdmesh mesh CA {cluster or secrets.token_hex(4)}", not_before, not_after)
    written: dict[str, Path] = {}

    def write_pair(stem: str, cert, key) -> None:
        written[f"{stem}.crt"] = _write_atomic(out / f"{stem}.crt", _cert_pem(cert), 0o644)
        written[f"{stem}.key"] = _write_atomic(out / f"{stem}.key", _key_pem(key), 0o600)

    server_client = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    for name in names:
        key = _new_key()
        cert = _leaf_cert(key, SERVICE_CN_PREFIX + name, ca_cert, ca_key, not_before, not_after,
                          server_client, x509.SubjectAlternativeName(sans))
        write_pair(name, cert, key)
    admin_key = _new_key()
    write_pair(ADMIN_NAME, _leaf_cert(admin_key, ADMIN_CN, ca_cert, ca_key, not_before, not_after,
                                      [ExtendedKeyUsageOID.CLIENT_AUTH], None), admin_key)
    write_pair("ca", ca_cert, ca_key)
    return written


def _check_name(name: str) -> None:
    if not _NAME_RE.fullmatch(name) or name in _RESERVED_NAMES:
        raise ValueError(f"service name must match {_NAME_RE.pattern} and not be one of {_RESERVED_NAMES} "
                         f"(it names NAME.crt / NAME.key), got {name!r}")


def _host_of_address(address: str) -> str:
    """'host:port' or '[v6]:port' -> host."""
    if address.startswith("["):
        return address[1:].split("]", 1)[0]
    return address.rsplit(":", 1)[0] if address.count(":") == 1 else address


def _unique_hosts(hosts: Iterable[str]) -> list[str]:
    out: dict[str, None] = {}
    for host in hosts:
        host = host.strip().strip("[]")
        if host.lower() not in UNSPECIFIED_HOSTS:
            out.setdefault(host.lower() if not _is_ip(host) else str(ipaddress.ip_address(host)), None)
    return list(out)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _san_entries(hosts: list[str]) -> list:
    from cryptography import x509
    entries = []
    for host in hosts:
        if _is_ip(host):
            entries.append(x509.IPAddress(ipaddress.ip_address(host)))
        elif re.fullmatch(r"(\*\.)?[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?(\.[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?)*\.?",
                          host):
            entries.append(x509.DNSName(host))
        else:
            raise ValueError(f"host must be an IP address or a DNS name (letters, digits, '-', '.'), got {host!r}")
    return entries


def _new_key():
    from cryptography.hazmat.primitives.asymmetric import ec
    return ec.generate_private_key(ec.SECP256R1())


def _name(common_name: str):
    from cryptography import x509
    from cryptography.x509.oid import NameOID
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "pdmesh"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _ca_cert(key, common_name: str, not_before, not_after):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    name = _name(common_name)
    return (x509.CertificateBuilder()
            .subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(not_before).not_valid_after(not_after)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))


def _leaf_cert(key, common_name: str, ca_cert, ca_key, not_before, not_after, usages, sans):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    builder = (x509.CertificateBuilder()
               .subject_name(_name(common_name)).issuer_name(ca_cert.subject)
               .public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(not_before).not_valid_after(not_after)
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, key_agreement=True,
                                            key_cert_sign=False, crl_sign=False, content_commitment=False,
                                            key_encipherment=False, data_encipherment=False,
                                            encipher_only=False, decipher_only=False), critical=True)
               .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                              critical=False))
    if sans is not None:
        builder = builder.add_extension(sans, critical=False)
    return builder.sign(ca_key, hashes.SHA256())


def _cert_pem(cert) -> bytes:
    from cryptography.hazmat.primitives import serialization
    return cert.public_bytes(serialization.Encoding.PEM)


def _key_pem(key) -> bytes:
    from cryptography.hazmat.primitives import serialization
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _write_atomic(path: Path, data: bytes, mode: int) -> Path:
    """Write data to a fresh temp file created with `mode` beside path, then rename it over path."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
