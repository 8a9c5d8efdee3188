"""Plaintext only on the loopback: the one rule every pdmesh service checks before it binds.

    check_bind("0.0.0.0", 50071, tls=False, allow_plaintext=False, service="decode-0")
        -> PlaintextBindError (a ValueError): one line naming the address, the risk and the fix
    check_mesh_binds(mesh, environ)    every service of a mesh config (`pdmesh up`, before starting)

A port without TLS may bind a loopback address (127.0.0.0/8, ::1, `localhost`) with no
configuration at all. Anywhere else (0.0.0.0, ::, "", a LAN address, any other host name:
names are not resolved, so the answer never depends on DNS) it needs TLS
(`security.tls_dir` / $PDMESH_TLS_DIR) or `security.allow_plaintext: true`.

Callers: services/cli/serve.py (before anything loads), services/node/grpc_util.bind (every
gRPC server, the HTTP API on the same host and TLS), the meta-server's dashboard (never
TLS), the `grpc` transfer backend's receiver (services/node/engine_node.transfer_options)
and `pdmesh up`. Metrics ports are not checked: they carry no secret and accept no call.
"""
from __future__ import annotations

import ipaddress
import os

LOOPBACK_NAMES = ("localhost",)
RISK = ("anyone who can reach that address can read the mesh's secrets (cluster secret, admin token, "
        "API keys) and every prompt and token off the wire, and with the cluster secret call every "
        "internal RPC (register a fake node, read and write the KV cache, drain nodes)")
FIX = ("Turn TLS on (security.tls_dir or $PDMESH_TLS_DIR, from `pdmesh certs init`), bind 127.0.0.1, "
       "or, on a network that only the mesh can reach, set security.allow_plaintext: true")
HTTP_ONLY_RISK = ("it speaks plain HTTP even with TLS on, and anyone who can reach that address can read the "
                  "admin token off the wire, then drain, remove and re-route nodes through the admin API")
HTTP_ONLY_FIX = ("Bind 127.0.0.1, set its port to 0 (off), or, on a network that only the mesh can reach, "
                 "set security.allow_plaintext: true")


class PlaintextBindError(ValueError):
    """A port without TLS was about to bind a non-loopback address; the message says how to fix it."""


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps a port on this machine only: 127.0.0.0/8, ::1 (also
    bracketed, or IPv4-mapped) and `localhost`. "" and the unspecified 0.0.0.0 / :: are
    every interface, so not loopback; any other name is not loopback (never resolved)."""
    bare = host.strip().removeprefix("[").removesuffix("]").lower()
    if bare in LOOPBACK_NAMES:
        return True
    try:
        address = ipaddress.ip_address(bare)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def check_bind(host: str, port: int, tls: bool, allow_plaintext: bool, service: str = "",
               http_only: bool = False) -> None:
    """Return when a port on host:port may bind: it speaks TLS, host is loopback, or the
    config allows plaintext. Else PlaintextBindError (before anything is bound).
    http_only: a port that never speaks TLS (the dashboard): the message says so."""
    if tls or allow_plaintext or is_loopback(host):
        return
    who = f"{service}: " if service else ""
    bare = host.strip().removeprefix("[").removesuffix("]")
    where = f"[{bare}]:{port}" if ":" in bare else f"{bare or '*'}:{port}"
    risk, fix = (HTTP_ONLY_RISK, HTTP_ONLY_FIX) if http_only else (RISK, FIX)
    raise PlaintextBindError(f"{who}refusing to serve plaintext on {where}, which is not a loopback address: "
                             f"{risk}. {fix}")


def tls_configured(security, environ=None) -> bool:
    """Whether a service of this SecurityConfig runs TLS (tls_dir, else $PDMESH_TLS_DIR)."""
    environ = os.environ if environ is None else environ
    return bool(security.tls_dir or environ.get("PDMESH_TLS_DIR", ""))


def check_mesh_binds(mesh, environ=None) -> None:
    """check_bind for every service a MeshConfig starts (meta-server and its dashboard,
    gateway, kv-store, nodes, the `grpc` transfer receivers), with TLS as
    security.tls_dir or $PDMESH_TLS_DIR says. Raises PlaintextBindError for the first
    that may not bind."""
    tls = tls_configured(mesh.security, environ)
    allow = mesh.security.allow_plaintext
    binds = [("meta-server", mesh.meta.host, mesh.meta.port), ("gateway", mesh.gateway.host, mesh.gateway.port)]
    if mesh.kv_store is not None:
        binds.append(("kv-store", mesh.kv_store.host, mesh.kv_store.port))
    binds += [(node.node_id, node.host, node.port) for node in mesh.nodes]
    if mesh.transfer.backend == "grpc":   # its receiver binds transfer.hostname, else the advertised host
        advertised = [(n.node_id, n.advertised_host) for n in mesh.nodes]
        if mesh.kv_store is not None:
            advertised.append(("kv-store", mesh.kv_store.advertise_host or mesh.kv_store.host))
        binds += [(f"{name} transfer (grpc backend)", mesh.transfer.hostname or host, 0) for name, host in advertised]
    for service, host, port in binds:
        check_bind(host, port, tls, allow, service)
    if mesh.meta.dashboard_port:   # plain HTTP, behind the admin token, whatever tls_dir says
        check_bind(mesh.meta.host, mesh.meta.dashboard_port, False, allow, "meta-server dashboard", http_only=True)
