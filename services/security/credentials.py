"""The secrets one process holds, read from files or the environment (never from a
command line, never logged).

    creds = load_credentials(mesh.security, "decode-0", api_keys_file=mesh.gateway.api_keys_file)
    install(creds)            # the process default that grpc_util.channel() dials with
    process_credentials()     # the installed one, else loaded from the environment alone

Where each secret comes from, first found wins:

    cluster secret   security.cluster_secret_file | $PDMESH_CLUSTER_SECRET_FILE | $PDMESH_CLUSTER_SECRET
    admin token      security.admin_token_file    | $PDMESH_ADMIN_TOKEN_FILE    | $PDMESH_ADMIN_TOKEN
    client API keys  gateway.api_keys_file        | $PDMESH_API_KEYS_FILE        (gateway side)
    TLS files        security.tls_dir             | $PDMESH_TLS_DIR

A file holds one secret (surrounding whitespace ignored); an API keys file one key per
line, `#` starts a comment. A service needs the cluster secret or TLS
(MissingCredentialsError otherwise): an internal port is never open to anyone.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

from common.config import SecurityConfig

MIN_SECRET_BYTES = 16


class MissingCredentialsError(ValueError):
    """A service was started without the mesh's identity; the message says how to give it."""


@dataclass(frozen=True)
class TLSFiles:
    """PEM bytes: the mesh CA and this process's certificate chain and key (None when the
    process has no certificate of its own, e.g. a public client)."""

    ca: bytes
    cert: bytes | None = None
    key: bytes | None = field(default=None, repr=False)


@dataclass(frozen=True, repr=False)
class MeshCredentials:
    """Secrets as bytes (compared in constant time by services/security/server_auth.py).
    repr() names which ones are set, never their values. allow_plaintext: the config's
    security.allow_plaintext, which services/security/bind_policy.py reads where a port binds."""

    cluster_secret: bytes | None = None
    admin_token: bytes | None = None
    api_keys: tuple[bytes, ...] = ()
    tls: TLSFiles | None = None
    allow_plaintext: bool = False

    def __repr__(self) -> str:
        have = [name for name in ("cluster_secret", "admin_token", "api_keys", "tls") if getattr(self, name)]
        return f"MeshCredentials(set: {', '.join(have) or 'nothing'})"

    @property
    def has_identity(self) -> bool:
        return self.cluster_secret is not None or (self.tls is not None and self.tls.cert is not None)


def checked_secret(value: bytes, what: str, where: str) -> bytes:
    """value, if it can be a secret: at least MIN_SECRET_BYTES of printable ASCII (it
    travels as gRPC metadata)."""
    if len(value) < MIN_SECRET_BYTES:
        raise MissingCredentialsError(f"{what} in {where} must be at least {MIN_SECRET_BYTES} bytes")
    if not all(33 <= b < 127 for b in value):
        raise MissingCredentialsError(f"{what} in {where} must be printable ASCII without spaces")
    return value


def read_secret(path: str | Path, what: str) -> bytes:
    """The secret in a file, stripped; MissingCredentialsError naming `what` when it is
    missing, too short or not printable ASCII."""
    try:
        value = Path(path).read_bytes().strip()
    except OSError as e:
        raise MissingCredentialsError(f"{what}: cannot read {path}: {e.strerror}") from None
    return checked_secret(value, what, str(path))


def read_api_keys(path: str | Path) -> tuple[bytes, ...]:
    try:
        lines = Path(path).read_bytes().splitlines()
    except OSError as e:
        raise MissingCredentialsError(f"API keys file: cannot read {path}: {e.strerror}") from None
    keys = tuple(k for k in (line.split(b"#", 1)[0].strip() for line in lines) if k)
    if not keys:
        raise MissingCredentialsError(f"API keys file {path} holds no key")
    return tuple(checked_secret(k, "every API key", str(path)) for k in keys)


def _secret(configured_file: str, file_env: str, value_env: str, what: str, environ) -> bytes | None:
    path = configured_file or environ.get(file_env, "")
    if path:
        return read_secret(path, what)
    value = environ.get(value_env, "").strip().encode()
    return checked_secret(value, what, f"${value_env}") if value else None


def tls_files(tls_dir: str, name: str | None) -> TLSFiles:
    """DIR/ca.crt plus DIR/NAME.crt + DIR/NAME.key (`pdmesh certs init` writes them; a
    mesh may share one "service" certificate). name None: the CA only."""
    base = Path(tls_dir)
    try:
        ca = (base / "ca.crt").read_bytes()
        if name is None:
            return TLSFiles(ca)
        for candidate in (name, "service"):
            if (base / f"{candidate}.crt").exists():
                return TLSFiles(ca, (base / f"{candidate}.crt").read_bytes(),
                                (base / f"{candidate}.key").read_bytes())
    except OSError as e:
        raise MissingCredentialsError(f"security.tls_dir: cannot read {e.filename}: {e.strerror}") from None
    raise MissingCredentialsError(f"security.tls_dir {tls_dir} has neither {name}.crt nor service.crt "
                                  f"(make them with `pdmesh certs init {tls_dir} --config ...`)")


def load_credentials(security: SecurityConfig = SecurityConfig(), service_name: str = "service",
                     api_keys_file: str = "", require_identity: bool = True,
                     environ=None) -> MeshCredentials:
    """What service `service_name` holds (environ: default os.environ). require_identity:
    MissingCredentialsError without a cluster secret or TLS (every service; False for
    clients)."""
    environ = os.environ if environ is None else environ
    secret = _secret(security.cluster_secret_file, "PDMESH_CLUSTER_SECRET_FILE", "PDMESH_CLUSTER_SECRET",
                     "cluster secret", environ)
    admin = _secret(security.admin_token_file, "PDMESH_ADMIN_TOKEN_FILE", "PDMESH_ADMIN_TOKEN", "admin token",
                    environ)
    keys_path = api_keys_file or environ.get("PDMESH_API_KEYS_FILE", "")
    keys = read_api_keys(keys_path) if keys_path else ()
    tls_dir = security.tls_dir or environ.get("PDMESH_TLS_DIR", "")
    tls = tls_files(tls_dir, service_name) if tls_dir else None
    creds = MeshCredentials(secret, admin, keys, tls, security.allow_plaintext)
    if require_identity and not creds.has_identity:
        raise MissingCredentialsError(
            "no cluster secret: internal RPCs need the mesh's identity. Set security.cluster_secret_file "
            "(or $PDMESH_CLUSTER_SECRET_FILE / $PDMESH_CLUSTER_SECRET), or security.tls_dir; "
            "`pdmesh up` makes them for you")
    return creds


_installed: MeshCredentials | None = None


def install(creds: MeshCredentials) -> None:
    """Make creds what this process's internal channels dial with."""
    global _installed
    _installed = creds


def install_default(creds: MeshCredentials) -> None:
    """install(creds) unless this process already has its credentials: a service started
    in-process (create_server with its config's credentials) dials with what it serves with."""
    if _installed is None:
        install(dataclasses.replace(creds, api_keys=()))   # its clients' keys are the gateway's own


def process_credentials() -> MeshCredentials:
    """The installed credentials, else those the environment gives (loaded once)."""
    global _installed
    if _installed is None:
        _installed = load_credentials(require_identity=False)
    return _installed
