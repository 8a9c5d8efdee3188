"""What a client command (`pdmesh generate`, `pdmesh admin`, the launcher) presents, found
without flags on a mesh that `pdmesh up` started.

    api_key(key_file)       --api-key-file | $PDMESH_API_KEY | $PDMESH_API_KEY_FILE | the running mesh's
    admin_token(token_file) --token-file | $PDMESH_ADMIN_TOKEN | $PDMESH_ADMIN_TOKEN_FILE | the running mesh's
    client_tls(tls_dir, cert_name)  --tls-dir | $PDMESH_TLS_DIR | the running mesh's; None = plaintext
    mesh_address(which)     "gateway" / "meta" of the running mesh, "" if none

"The running mesh's" is what the last `pdmesh up` recorded (services/security/mesh_secrets.py
state(): paths, never values), and only for a call to one of the addresses it recorded:
a command aimed elsewhere never sends the local mesh's secrets there. A key file's first
key is used.
"""
from __future__ import annotations

import os

from services.security.credentials import TLSFiles, read_api_keys, read_secret, tls_files
from services.security.mesh_secrets import state


def _recorded(environ, address: str) -> dict[str, str]:
    """The running mesh's record when `address` is one of its services' ("" = the caller
    took its address from the record too), else {}."""
    record = state(environ)
    if address and address not in (record.get("gateway"), record.get("meta"), record.get("kv_store")):
        return {}
    return record


def _find(explicit_file: str, value_env: str, file_env: str, state_key: str, environ, address: str) -> str | None:
    environ = os.environ if environ is None else environ
    if explicit_file:
        return read_api_keys(explicit_file)[0].decode()
    if environ.get(value_env, "").strip():
        return environ[value_env].strip()
    path = environ.get(file_env) or _recorded(environ, address).get(state_key, "")
    return read_api_keys(path)[0].decode() if path else None


def api_key(key_file: str = "", environ=None, address: str = "") -> str | None:
    return _find(key_file, "PDMESH_API_KEY", "PDMESH_API_KEY_FILE", "api_keys_file", environ, address)


def admin_token(token_file: str = "", environ=None, address: str = "") -> str | None:
    if token_file:
        return read_secret(token_file, "admin token").decode()
    return _find("", "PDMESH_ADMIN_TOKEN", "PDMESH_ADMIN_TOKEN_FILE", "admin_token_file", environ, address)


def client_tls(tls_dir: str = "", cert_name: str | None = None, environ=None, address: str = "") -> TLSFiles | None:
    """The CA (and cert_name's certificate, e.g. "admin": the meta-server's port asks
    clients for one) when TLS is on."""
    environ = os.environ if environ is None else environ
    folder = tls_dir or environ.get("PDMESH_TLS_DIR", "") or _recorded(environ, address).get("tls_dir", "")
    return tls_files(folder, cert_name) if folder else None


def operator_channel(address: str, token_file: str = "", tls_dir: str = ""):
    """A blocking channel as the operator (admin token; with TLS, admin.crt) to address.
    MissingCredentialsError when a named file cannot be read."""
    from services.security.client_auth import client_channel
    return client_channel(address, bearer=admin_token(token_file, address=address),
                          tls=client_tls(tls_dir, "admin", address=address), sync=True)


def mesh_address(which: str, environ=None) -> str:
    return state(environ).get(which, "")
