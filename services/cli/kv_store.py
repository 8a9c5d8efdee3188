"""`pdmesh kv-store stats --kv-store HOST:PORT [--json]`: what a running kv-store holds and
how it is doing (its pdmesh.v1.KVStore Stats): blocks used / total / pinned, hits and
misses, evictions, bytes in and out, and the Redis tier (configured, up, spilled,
promoted, errors, last error).

--kv-store defaults to $PDMESH_KV_STORE or 127.0.0.1:50080. Exit code 0; 1 with the
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
                   default=os.environ.get("PDMESH_KV_STORE", "127.0.0.1:50080"),
                   help="kv-store address (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print JSON instead of lines")
    return p


def run(args: argparse.Namespace) -> int:
    import grpc
    from protos.pdmesh.v1 import kv_store_pb2, kv_store_pb2_grpc
    try:
        with grpc.insecure_channel(args.address) as channel:
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
