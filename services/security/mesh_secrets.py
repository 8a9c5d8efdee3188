"""Fresh secrets for one mesh (`pdmesh up` without configured ones), and where a running
mesh's client credentials are, so that `pdmesh generate` and `pdmesh admin` find them.

    env = make_missing_secrets(mesh_cfg, DIR)   # writes DIR/{cluster_secret,admin_token,api_keys}
    write_state({...})                          # ~/.pdmesh/mesh.json ($PDMESH_STATE_DIR)
    state()                                     # what the last `pdmesh up` wrote, {} if none

Files are created 0600 in a 0700 folder, never world-readable even for an instant; the
values go to the children in files named by environment variables, never on a command
line, and never into a log.
"""
from __future__ import annotations

import json
import os
import secrets
from pathlib import Path


def write_private(path: Path, data: str) -> None:
    """Write data to path, mode 0600 from the first byte (temp file + rename)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(data)
    os.replace(tmp, path)


def new_secret() -> str:
    return secrets.token_urlsafe(32)


def make_missing_secrets(mesh, folder: Path, environ=None) -> dict[str, str]:
    """For each secret neither the config nor the environment gives, a fresh one in
    folder; returns the environment variables that name the files (for the children).
    With TLS the certificates are the mesh's identity: no cluster secret is made."""
    environ = os.environ if environ is None else environ
    sec = mesh.security
    wanted = []
    tls = sec.tls_dir or environ.get("PDMESH_TLS_DIR")
    if not (tls or sec.cluster_secret_file or environ.get("PDMESH_CLUSTER_SECRET_FILE")
            or environ.get("PDMESH_CLUSTER_SECRET")):
        wanted.append(("PDMESH_CLUSTER_SECRET_FILE", "cluster_secret"))
    if not (sec.admin_token_file or environ.get("PDMESH_ADMIN_TOKEN_FILE") or environ.get("PDMESH_ADMIN_TOKEN")):
        wanted.append(("PDMESH_ADMIN_TOKEN_FILE", "admin_token"))
    if not (mesh.gateway.api_keys_file or environ.get("PDMESH_API_KEYS_FILE")):
        wanted.append(("PDMESH_API_KEYS_FILE", "api_keys"))
    if not wanted:
        return {}
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(folder, 0o700)
    env = {}
    for variable, name in wanted:
        write_private(folder / name, new_secret() + "\n")
        env[variable] = str(folder / name)
    return env


def state_path(environ=None) -> Path:
    environ = os.environ if environ is None else environ
    base = environ.get("PDMESH_STATE_DIR") or str(Path.home() / ".pdmesh")
    return Path(base) / "mesh.json"


def write_state(values: dict[str, str], environ=None) -> Path:
    """Record where the running mesh is and where its client credentials are (paths,
    never the secrets themselves)."""
    path = state_path(environ)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    write_private(path, json.dumps(values, indent=1) + "\n")
    return path


def clear_state(values: dict[str, str], environ=None) -> None:
    """Remove the record if it is still ours (another mesh may have written it since)."""
    path = state_path(environ)
    try:
        if json.loads(path.read_text()) == values:
            path.unlink()
    except (OSError, ValueError):
        pass


def state(environ=None) -> dict[str, str]:
    try:
        return json.loads(state_path(environ).read_text())
    except (OSError, ValueError):
        return {}
