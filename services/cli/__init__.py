"""The `pdmesh` command: one argparse parser, one small module per subcommand.

Each module named in SUBCOMMANDS provides
    add_parser(subparsers) -> argparse.ArgumentParser   registers its subcommand
    run(args: argparse.Namespace) -> int                 does the work, returns exit code
and keeps heavy imports (torch, grpc, ...) inside run(), so `pdmesh --help` and every
other subcommand work even where one backend is not installed.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

SUBCOMMANDS: tuple[str, ...] = (
    "services.cli.tiny",
    "services.cli.generate",
    "services.cli.serve",
    "services.cli.up",
    "services.cli.admin",
    "services.cli.drain",
    "services.cli.top",
    "services.cli.kv_store",
    "services.cli.health",
    "services.cli.certs",
    "services.cli.secrets",
    "services.cli.bench",
    "services.cli.models",
    "services.cli.eval",
    "services.cli.quantize",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdmesh", description="Prefill/decode-disaggregated LLM serving mesh.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module_name in SUBCOMMANDS:
        module = importlib.import_module(module_name)
        sub = module.add_parser(subparsers)
        sub.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse argv (default sys.argv[1:]) and run the chosen subcommand; return its exit code."""
    args = build_parser().parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
