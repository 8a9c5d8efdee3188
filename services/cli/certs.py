"""`pdmesh certs init DIR [--config MESH.yaml] [--names a,b] [--hosts h1,h2] [--pool NAME=N] [--days N] [--force]`:
make the TLS files of a mesh (services/security/certs.py) for security.tls_dir / $PDMESH_TLS_DIR.

DIR (created 0700) gets a fresh mesh CA (ca.crt, ca.key), NAME.crt + NAME.key for every
service (CN service:NAME, serverAuth + clientAuth) and admin.crt + admin.key (CN
admin:operator, clientAuth) for `pdmesh admin` and health checks. Keys are mode 0600.

Services: --names, else those of --config (meta-server, meta-server-1..K for standbys,
gateway, kv-store, every node_id), else one shared "service". Every service cert names
localhost, 127.0.0.1, ::1, each --hosts entry and each host of --config as its SANs.
--pool NAME=N (repeatable) adds the N pods of a scaled pool (deploy/k8s: the StatefulSet
NAME, pods NAME-0 .. NAME-{N-1}, each registering as its pod name): a cert for each, and
the SAN *.NAME (the pods' names under its headless Service) on every cert.

An existing DIR/ca.key is replaced only with --force (every cert the old CA signed stops
verifying against the new one). Exit code 0; 2 on a bad argument or an existing CA.
"""
from __future__ import annotations

import argparse
import sys


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("certs", help="make the mesh's TLS certificates", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    init = actions.add_parser("init", help="write a fresh CA and a cert per service into DIR")
    init.add_argument("dir", metavar="DIR", help="output folder (created 0700)")
    init.add_argument("--config", default="", metavar="MESH.yaml", help="take service names and hosts from it")
    init.add_argument("--names", default="", metavar="A,B,...", help="service names (overrides --config's)")
    init.add_argument("--hosts", default="", metavar="H1,H2,...", help="extra DNS names / IPs for every service")
    init.add_argument("--pool", action="append", default=[], metavar="NAME=N",
                      help="a scaled pool's pods NAME-0..NAME-{N-1}: a cert each, SAN *.NAME (repeatable)")
    init.add_argument("--days", type=int, default=365, help="validity in days (default: %(default)s)")
    init.add_argument("--force", action="store_true", help="replace an existing CA in DIR")
    return p


def _split(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def pool_names(specs: list[str]) -> tuple[list[str], list[str]]:
    """--pool NAME=N entries -> (the pods' names NAME-0 .. NAME-{N-1}, hosts *.NAME);
    ValueError naming the entry."""
    names, hosts = [], []
    for spec in specs:
        name, _, count = spec.partition("=")
        if not name or not count.isdigit() or int(count) < 1:
            raise ValueError(f"--pool must be NAME=N with N >= 1 (the pool's most pods), got {spec!r}")
        names += [f"{name}-{i}" for i in range(int(count))]
        hosts.append(f"*.{name}")
    return names, hosts


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from services.security.certs import CA_CERT_FILE, CA_KEY_FILE, hosts_of, init_certs, service_names

    names, hosts, cluster = _split(args.names), _split(args.hosts), ""
    try:
        if args.config:
            from common.config import load_mesh_config
            mesh = load_mesh_config(args.config)
            names = names or service_names(mesh)
            hosts += hosts_of(mesh)
            cluster = mesh.cluster
        pods, pod_hosts = pool_names(args.pool)
        names, hosts = names + pods, hosts + pod_hosts
        written = init_certs(args.dir, names, hosts, days=args.days, cluster=cluster, force=args.force)
    except FileExistsError:
        print(f"pdmesh certs init: error: {Path(args.dir) / CA_KEY_FILE} exists; a new CA would invalidate "
              "every certificate the old one signed. Pass --force to replace it.", file=sys.stderr)
        return 2
    except (ValueError, OSError) as e:
        print(f"pdmesh certs init: error: {e}", file=sys.stderr)
        return 2
    for path in written.values():
        print(f"wrote {path}")
    print(f"mesh CA: {written[CA_CERT_FILE]} (key {written[CA_KEY_FILE]}); "
          f"set security.tls_dir or PDMESH_TLS_DIR to {Path(args.dir).resolve()}")
    print(f"keep {written[CA_KEY_FILE]} off the mesh's machines (it mints any service's identity); "
          "give each service ca.crt and its own NAME.crt / NAME.key only")
    return 0
