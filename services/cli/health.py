"""`pdmesh health HOST:PORT [--cert NAME] [--tls-dir DIR] [--service NAME] [--timeout S]`: ask a
pdmesh port's grpc.health.v1 once, as a Kubernetes exec probe or a compose healthcheck does.

Prints one line (SERVING, NOT_SERVING, or the status of a call that got no answer) and
exits 0 only on SERVING; 1 otherwise; 2 when the TLS files cannot be read.

TLS files: --tls-dir | $PDMESH_TLS_DIR | the running `pdmesh up` mesh's (for its own
addresses); none: plaintext. With TLS every port but the gateway's asks the caller for a
certificate of the mesh CA in the handshake (mTLS), so a health check there must present
one: --cert NAME sends DIR/NAME.crt (in a service's pod or container its own name, e.g.
decode-0; an operator: admin). Without one such a port completes no handshake and the
answer is UNAVAILABLE (docs/security.md, "Health checks and Kubernetes probes").
"""
from __future__ import annotations

import argparse
import sys


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("health", help="ask a service's grpc health once (probes)", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("address", metavar="HOST:PORT")
    p.add_argument("--cert", default="", metavar="NAME",
                   help="present DIR/NAME.crt + NAME.key (needed by every port but the gateway's under TLS)")
    p.add_argument("--tls-dir", default="", metavar="DIR", help="the mesh's TLS files (default $PDMESH_TLS_DIR)")
    p.add_argument("--service", default="", help="a grpc.health service name (default: the server as a whole)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer (default %(default)s)")
    return p


def run(args: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from services.security.client_auth import client_channel
    from services.security.client_creds import client_tls
    from services.security.credentials import MissingCredentialsError

    try:
        tls = client_tls(args.tls_dir, args.cert or None, address=args.address)
    except MissingCredentialsError as e:
        print(f"pdmesh health: error: {e}", file=sys.stderr)
        return 2
    if args.cert and tls is None:
        print("pdmesh health: error: --cert needs the TLS files (--tls-dir or $PDMESH_TLS_DIR)", file=sys.stderr)
        return 2
    request = health_pb2.HealthCheckRequest(service=args.service)
    with client_channel(args.address, tls=tls, sync=True) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(request, timeout=args.timeout)
        except grpc.RpcError as e:
            hint = ""
            if e.code() == grpc.StatusCode.UNAVAILABLE and tls is not None and tls.cert is None:
                hint = " (no certificate presented: under TLS an internal port needs --cert NAME)"
            print(f"{e.code().name}: {e.details()}{hint}", flush=True)
            return 1
    print(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status), flush=True)
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1
