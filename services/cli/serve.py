"""`pdmesh serve ROLE --config FILE`: run one service of a mesh config in this process.

ROLE is meta-server, gateway, kv-store, prefill, decode or both; engine roles pick their
entry of `nodes` by --node-id (default: the first node of that role). --port / --meta /
--kv-store / --metrics-port / --advertise-host override the file, so a launcher can hand
out free ports and a pod its own name. --node-name NAME makes an engine node register as
NAME with --node-id's entry as everything else (role, ports, engine fields): the pods of a
scaled pool (deploy/k8s: StatefulSet decode-pool, NAME its pod's name) share one entry;
its certificate is NAME's own (NAME.crt: with TLS a node registers only as itself).

Credentials (services/security/credentials.py): the cluster secret (or TLS files), the
admin token and the gateway's API keys come from the config's `security:` section and
`gateway.api_keys_file`, or the environment; never from the command line. Without the
mesh's identity the service does not start (exit code 2), nor without TLS on a host that
is not loopback unless the config says `security.allow_plaintext: true` (exit code 2,
before the model loads: services/security/bind_policy.py).
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import signal

ROLES = ("meta-server", "gateway", "kv-store", "prefill", "decode", "both")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="run one service", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("role", choices=ROLES)
    p.add_argument("--config", required=True, help="mesh YAML (e.g. deploy/local.yaml)")
    p.add_argument("--node-id", default="", help="engine roles: which nodes[] entry")
    p.add_argument("--node-name", default="",
                   help="engine roles: register as this node id, with --node-id's entry as its config "
                        "(a pod of a scaled pool: its own name)")
    p.add_argument("--port", type=int, default=None, help="override the configured port")
    p.add_argument("--meta", default="", help="override the meta-server address HOST:PORT")
    p.add_argument("--kv-store", default="", help="override the kv-store address HOST:PORT")
    p.add_argument("--advertise-host", default="",
                   help="override the role's advertise_host (the name others dial; e.g. a "
                        "StatefulSet pod's own DNS name, so that two meta-servers differ)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="override this service's metrics_port (GET /metrics; 0 = off)")
    p.add_argument("--borrow-cores", default="",
                   help="decode nodes: the engine's borrow_cores (\"1\", \"2-3\"): the prefill node's "
                        "cores its steps also run on while none of its prompts is prefilled remotely")
    p.add_argument("--log-level", default="INFO")
    return p


def _apply_overrides(mesh, args):
    """--meta HOST:PORT[,HOST:PORT...]: the first is the meta-server; all of them are the
    ones the gateway follows."""
    if args.meta:
        addresses = [a.strip() for a in args.meta.split(",") if a.strip()]
        host, _, port = addresses[0].rpartition(":")
        mesh = dataclasses.replace(mesh, meta=dataclasses.replace(
            mesh.meta, host=host, port=int(port), advertise_host=""))
        if len(addresses) > 1:
            mesh = dataclasses.replace(mesh, gateway=dataclasses.replace(
                mesh.gateway, meta_addresses=tuple(addresses)))
    if args.kv_store:
        if mesh.kv_store is None:
            raise ValueError("--kv-store given but the config has no kv_store section")
        host, _, port = args.kv_store.rpartition(":")
        mesh = dataclasses.replace(mesh, kv_store=dataclasses.replace(
            mesh.kv_store, host=host, port=int(port), advertise_host=""))
    return mesh


def _with_metrics_port(mesh, node_cfg, role: str, port: int):
    """(mesh, node_cfg) with role's metrics_port set to port."""
    if node_cfg is not None:
        return mesh, dataclasses.replace(node_cfg, metrics_port=port)
    if role == "meta-server":
        return dataclasses.replace(mesh, meta=dataclasses.replace(mesh.meta, metrics_port=port)), None
    if role == "gateway":
        return dataclasses.replace(mesh, gateway=dataclasses.replace(mesh.gateway, metrics_port=port)), None
    if mesh.kv_store is None:
        raise ValueError("--metrics-port given for kv-store but the config has no kv_store section")
    return dataclasses.replace(mesh, kv_store=dataclasses.replace(mesh.kv_store, metrics_port=port)), None


def _node_config(mesh, role: str, node_id: str):
    if node_id:
        node = mesh.node(node_id)
        if node.role != role:
            raise ValueError(f"--node-id {node_id} has role {node.role}, not {role}")
        return node
    for node in mesh.nodes:
        if node.role == role:
            return node
    raise ValueError(f"nodes has no entry of role {role!r}")


def with_node_name(node_cfg, role: str, name: str):
    """node_cfg (a nodes[] entry) as the node `name`: its own id (what it registers as, and
    its certificate's name), everything else the entry's. ValueError for a role that is
    not an engine's or an empty name."""
    if node_cfg is None:
        raise ValueError(f"--node-name is for the engine roles (prefill, decode, both), not {role}")
    if not name.strip():
        raise ValueError("--node-name must not be empty")
    return dataclasses.replace(node_cfg, node_id=name.strip())


def _with_advertise_host(mesh, node_cfg, role: str, host: str):
    """(mesh, node_cfg) with role's advertise_host set to host."""
    if node_cfg is not None:
        return mesh, dataclasses.replace(node_cfg, advertise_host=host)
    if role == "meta-server":
        return dataclasses.replace(mesh, meta=dataclasses.replace(mesh.meta, advertise_host=host)), None
    if role == "kv-store" and mesh.kv_store is not None:
        return dataclasses.replace(mesh, kv_store=dataclasses.replace(mesh.kv_store, advertise_host=host)), None
    raise ValueError(f"--advertise-host is not served for {role} (it has no advertise_host)")


def _check_bind_host(mesh, node_cfg, args, credentials) -> None:
    """Refuse (PlaintextBindError, exit 2) before anything loads when the role's host is
    not loopback and neither TLS nor security.allow_plaintext is on (bind_policy.py; the
    bind itself checks again)."""
    from services.security.bind_policy import check_bind
    if node_cfg is not None:
        name, host, port = node_cfg.node_id, node_cfg.host, node_cfg.port
    elif args.role == "meta-server":
        name, host, port = "meta-server", mesh.meta.host, mesh.meta.port
    elif args.role == "gateway":
        name, host, port = "gateway", mesh.gateway.host, mesh.gateway.port
    elif mesh.kv_store is not None:
        name, host, port = "kv-store", mesh.kv_store.host, mesh.kv_store.port
    else:
        return   # create_server says the kv_store section is missing
    check_bind(host, port if args.port is None else args.port, credentials.tls is not None,
               credentials.allow_plaintext, name)


async def _serve(args) -> None:
    from common.config import load_mesh_config
    from common.metrics import close_metrics
    from services.security.credentials import install, load_credentials
    mesh = _apply_overrides(load_mesh_config(args.config), args)
    node_cfg = _node_config(mesh, args.role, args.node_id) if args.role in ("prefill", "decode", "both") else None
    if args.node_name:
        node_cfg = with_node_name(node_cfg, args.role, args.node_name)
    if args.metrics_port is not None:
        mesh, node_cfg = _with_metrics_port(mesh, node_cfg, args.role, args.metrics_port)
    if args.advertise_host:
        mesh, node_cfg = _with_advertise_host(mesh, node_cfg, args.role, args.advertise_host)
    if args.borrow_cores:
        if args.role != "decode":
            raise ValueError(f"--borrow-cores is for the decode role, not {args.role}")
        node_cfg = dataclasses.replace(node_cfg, engine={**node_cfg.engine, "borrow_cores": args.borrow_cores})
    name = node_cfg.node_id if node_cfg is not None else args.role
    credentials = load_credentials(mesh.security, name,
                                   mesh.gateway.api_keys_file if args.role == "gateway" else "")
    install(credentials)
    _check_bind_host(mesh, node_cfg, args, credentials)
    if args.role == "meta-server":
        from services.meta_server.server import create_server
        meta = mesh.meta if args.port is None else dataclasses.replace(mesh.meta, port=args.port)
        server, _ = await create_server(meta, etcd=mesh.etcd_config(),
                                        kv_store_address=mesh.kv_store.address if mesh.kv_store else "",
                                        kv_store_lookup_s=mesh.timeouts.kv_store_lookup_s,
                                        credentials=credentials)

        async def stop(grace):
            await server.stop(grace)
            await server.close_extras()
    elif args.role == "kv-store":
        from services.kv_store.server import create_server, stop_server
        server, _ = await create_server(mesh, args.port, credentials)

        async def stop(grace):
            await stop_server(server, grace)
    elif args.role == "gateway":
        from services.gateway.server import create_server
        server, _ = await create_server(mesh, args.port, credentials)

        async def stop(grace):
            from services.gateway.server import stop_http
            await close_metrics(server)
            await stop_http(server, grace)
            await server.stop(grace)
            await server.servicer.close()   # its tokenizer pool and channels
    failed = asyncio.Event()   # set when the service cannot serve any more
    if args.role in ("prefill", "decode", "both"):
        from services.node.node_server import create_node_server, stop_node_server
        server, _ = await create_node_server(mesh, node_cfg, args.port, credentials)
        failed = server.health.failed

        async def stop(grace):
            await stop_node_server(server, grace)
    done = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, done.set)
    waits = [asyncio.ensure_future(done.wait()), asyncio.ensure_future(failed.wait())]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for w in waits:
        w.cancel()
    await stop(1.0)
    if failed.is_set():
        raise ServiceFailed(f"{args.role} {args.node_id or ''}: the engine died; exiting for a restart")


class ServiceFailed(RuntimeError):
    """The service stopped serving on its own (e.g. its engine died): exit code 1."""


def run(args: argparse.Namespace) -> int:
    from common.bind_error import EXIT_CODE, BindError
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s: %(message)s")
    try:
        asyncio.run(_serve(args))
    except ValueError as e:
        print(f"error: {e}")
        return 2
    except BindError as e:
        print(f"error: {e}", flush=True)
        return EXIT_CODE
    except ServiceFailed as e:
        print(f"error: {e}", flush=True)
        return 1
    return 0
