"""`pdmesh kv-store stats --kv-store HOST:PORT [--json]`: what a running kv-store holds and
how it is doing (its pdmesh.v1.KVStore Stats): blocks used / total / pinned, hits and
misses, evictions, bytes in and out, and the Redis tier (configured, up, spilled,
promoted, errors, last error).

--kv-store defaults to $PDMESH_KV_STORE, else the mesh `pdmesh up` runs, else
127.0.0.1:50080. Stats take the admin token (--token-file, $PDMESH_ADMIN_TOKEN(_FILE) or
the running mesh's) and, with TLS, admin.crt of --tls-dir. Exit code 0; 1 with the
status on stderr when the store cannot be reached.
"""
from __future__ import annotations

import argparse
import json
import os
import sys


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("kv-store", help="inspect a running kv-store", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", choices=["stats"])
    p.add_argument("--kv-store", dest="address", metavar="HOST:PORT",
                   default=os.environ.get("PDMESH_KV_STORE", ""),
                   help="kv-store address (default: the running mesh's, else 127.0.0.1:50080)")
    p.add_argument("--token-file", default="", help="file holding the admin token")
    p.add_argument("--tls-dir", default="", help="folder of `pdmesh certs init` (TLS on)")
    p.add_argument("--json", action="store_true", help="print JSON instead of lines")
    return p


def run(args: argparse.Namespace) -> int:
    import grpc
    from protos.pdmesh.v1 import kv_store_pb2, kv_store_pb2_grpc
    from services.security.client_creds import mesh_address, operator_channel
    from services.security.credentials import MissingCredentialsError
    args.address = args.address or mesh_address("kv_store") or "127.0.0.1:50080"
    try:
        channel = operator_channel(args.address, args.token_file, args.tls_dir)
    except MissingCredentialsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        with channel:
            stats = kv_store_pb2_grpc.KVStoreStub(channel).Stats(kv_store_pb2.StatsRequest(), timeout=5)
    except grpc.RpcError as e:
        print(f"kv-store {args.address}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    fields = {f.name: getattr(stats, f.name) for f in stats.DESCRIPTOR.fields}
    if args.json:
        print(json.dumps(fields, indent=2))
        return 0
    width = max(len(k) for k in fields)
    for key, value in fields.items():
        print(f"{key:<{width}}  {value}")
    return 0
