"""`pdmesh secrets init DIR [--force]`: the secrets of a mesh that `pdmesh up` does not
start (docker-compose, Kubernetes, bare metal by hand), one file each, mode 0600 in a 0700
folder:

    cluster_secret   every internal RPC carries it (security.cluster_secret_file,
                     $PDMESH_CLUSTER_SECRET_FILE)
    admin_token      pdmesh.v1.MetaAdmin (security.admin_token_file, $PDMESH_ADMIN_TOKEN_FILE;
                     `pdmesh admin --token-file`)
    api_keys         the gateway's client keys, one per line (gateway.api_keys_file,
                     $PDMESH_API_KEYS_FILE; `pdmesh generate --api-key-file`)

Existing files are kept unless --force (then every service and client must be given the
new ones: docs/security.md, "Rotating keys"). Nothing is printed but the paths.
"""
from __future__ import annotations

import argparse
import sys

NAMES = ("cluster_secret", "admin_token", "api_keys")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("secrets", help="make a mesh's cluster secret, admin token and API key",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    init = actions.add_parser("init", help="write the secret files into DIR")
    init.add_argument("dir", metavar="DIR", help="output folder (created 0700)")
    init.add_argument("--force", action="store_true", help="replace existing files")
    return p


def run(args: argparse.Namespace) -> int:
    import os
    from pathlib import Path

    from services.security.mesh_secrets import new_secret, write_private
    folder = Path(args.dir)
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(folder, 0o700)
        for name in NAMES:
            path = folder / name
            if path.exists() and not args.force:
                print(f"kept {path}")
                continue
            write_private(path, new_secret() + "\n")
            print(f"wrote {path}")
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
