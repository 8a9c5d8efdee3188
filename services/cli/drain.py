"""`pdmesh drain NODE [--wait HOST:PORT] [--config FILE | --meta A,B] [--cert NAME] [--timeout S]`:
take an engine node out of service without losing a request, e.g. a pod's preStop hook
(deploy/k8s: a scaled pool's pods drain themselves before Kubernetes stops them).

    drain     MetaAdmin/DrainNode at the leading meta-server: nothing new is routed to NODE
              (each meta-server is tried in turn; a standby refuses with FAILED_PRECONDITION)
    --wait    then poll the node's GetEngineStats at HOST:PORT until nothing runs, waits or
              moves KV there (running, waiting, kv_remote, held, pending_transfers and
              quarantined_blocks all 0) for DRAIN_SETTLE_S: then exit 0 and let it stop
    --undo    UndrainNode instead (a node the meta-server does not know: nothing to undo);
              a pool's pod does this as it starts, since the drained flag is kept by node id

The meta-servers: --meta, else the config's (gateway.meta_addresses, else meta_server's
advertised address), else the running mesh's (`pdmesh up`), else 127.0.0.1:50051. As the
operator: the admin token ($PDMESH_ADMIN_TOKEN(_FILE) or the running mesh's); with TLS
($PDMESH_TLS_DIR) the certificate --cert names (default admin; a pod uses its own).

Exit code 0; 1 when no meta-server took the drain or the node was still busy at --timeout
(it is left drained); 2 on a bad argument or missing credentials.
"""
from __future__ import annotations

import argparse
import sys
import time

POLL_S = 0.5


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("drain", help="drain an engine node (and wait until it is idle)", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("node_id", metavar="NODE")
    p.add_argument("--wait", default="", metavar="HOST:PORT", help="the node's address: wait until it is idle")
    p.add_argument("--undo", action="store_true", help="undrain NODE instead")
    p.add_argument("--config", default="", help="mesh YAML: where the meta-servers are")
    p.add_argument("--meta", default="", metavar="A,B", help="meta-server addresses (override --config)")
    p.add_argument("--cert", default="admin", help="with TLS: the certificate of $PDMESH_TLS_DIR to present")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds to try and to wait in all")
    return p


def meta_addresses(args) -> list[str]:
    if args.meta:
        return [a.strip() for a in args.meta.split(",") if a.strip()]
    if args.config:
        from common.config import load_mesh_config
        mesh = load_mesh_config(args.config)
        if mesh.gateway.meta_addresses:
            return list(mesh.gateway.meta_addresses)
        if mesh.meta.port:
            return [f"{mesh.meta.advertise_host or mesh.meta.host}:{mesh.meta.port}"]
    from services.security.client_creds import mesh_address
    return [mesh_address("meta") or "127.0.0.1:50051"]


def _channel(address: str, cert: str):
    from services.security.client_auth import client_channel
    from services.security.client_creds import admin_token, client_tls
    return client_channel(address, bearer=admin_token(), tls=client_tls(cert_name=cert, address=address), sync=True)


def _at_leader(addresses: list[str], cert: str, call, deadline: float) -> tuple[str, str]:
    """call(MetaAdminStub) at the first meta-server that takes it, trying the list again
    until deadline; returns (address, "") or ("", the last refusal). NOT_FOUND counts as
    taken (address, "not found")."""
    import grpc

    from protos.pdmesh.v1 import meta_pb2_grpc
    last = ""
    while True:
        for address in addresses:
            try:
                with _channel(address, cert) as channel:
                    call(meta_pb2_grpc.MetaAdminStub(channel))
                return address, ""
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.NOT_FOUND:
                    return address, "not found"
                last = f"{address}: {e.code().name}: {e.details()}"
                if e.code() not in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAVAILABLE,
                                    grpc.StatusCode.DEADLINE_EXCEEDED):
                    return "", last
        if time.monotonic() >= deadline:
            return "", last
        time.sleep(POLL_S)


def wait_idle(address: str, cert: str, deadline: float) -> dict[str, int] | None:
    """Poll GetEngineStats at address until busy() stayed empty DRAIN_SETTLE_S; returns
    None then, else (at deadline) what still held it ({} : no answer)."""
    import grpc

    from protos.pdmesh.v1 import engine_pb2, engine_pb2_grpc
    from services.cli.autoscale_plan import PoolNode, busy, may_stop
    probe = PoolNode("", "", from_config=False, seq=0)
    with _channel(address, cert) as channel:
        stubs = [engine_pb2_grpc.DecodeStub(channel), engine_pb2_grpc.PrefillStub(channel)]
        while True:
            work = None
            for stub in list(stubs):
                try:
                    work = busy(stub.GetEngineStats(engine_pb2.EngineStatsRequest(), timeout=2))
                    break
                except grpc.RpcError as e:
                    if e.code() == grpc.StatusCode.UNIMPLEMENTED:   # the other role's service
                        stubs.remove(stub)
                        continue
                    break
            now = time.monotonic()
            if may_stop(probe, work, now):
                return None
            if now >= deadline:
                return work or {}
            time.sleep(POLL_S)


def run(args: argparse.Namespace) -> int:
    from protos.pdmesh.v1 import meta_pb2
    from services.cli.autoscale_plan import describe_work
    from services.security.credentials import MissingCredentialsError
    deadline = time.monotonic() + args.timeout
    try:
        addresses = meta_addresses(args)
        if args.undo:
            at, note = _at_leader(addresses, args.cert, lambda stub: stub.UndrainNode(
                meta_pb2.UndrainNodeRequest(node_id=args.node_id), timeout=5), deadline)
        else:
            at, note = _at_leader(addresses, args.cert, lambda stub: stub.DrainNode(
                meta_pb2.DrainNodeRequest(node_id=args.node_id), timeout=5), deadline)
    except (MissingCredentialsError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not at:
        print(f"error: no meta-server took the {'undrain' if args.undo else 'drain'} of {args.node_id} ({note})",
              file=sys.stderr)
        return 1
    if args.undo:
        print(f"{args.node_id}: {'not known at ' + at + ': nothing to undo' if note else 'undrained at ' + at}",
              flush=True)
        return 0
    print(f"{args.node_id}: {'not registered at ' + at + ': nothing is routed to it' if note else 'drained at ' + at}",
          flush=True)
    if not args.wait:
        return 0
    start = time.monotonic()
    left = wait_idle(args.wait, args.cert, deadline)
    if left is not None:
        print(f"error: {args.node_id} still busy after {time.monotonic() - start:.0f}s ({describe_work(left or None)}); "
              "left drained", file=sys.stderr)
        return 1
    print(f"{args.node_id}: idle after {time.monotonic() - start:.1f}s (nothing running, waiting or moving KV)",
          flush=True)
    return 0
