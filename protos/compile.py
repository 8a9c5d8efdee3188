"""Regenerate the committed Python code of protos/pdmesh/v1/*.proto.

    python protos/compile.py          # rewrite *_pb2.py, *_pb2_grpc.py, *_pb2.pyi
    python protos/compile.py --check  # exit 1 and name the stale files if any differ

Generated imports are rewritten from `pdmesh.v1` to `protos.pdmesh.v1`, so the code
imports as a normal package from the repository root.
"""
from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent
PROTO_DIR = ROOT / "pdmesh" / "v1"
SUFFIXES = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")


def generate(out_dir: Path) -> None:
    from grpc_tools import protoc
    import grpc_tools
    include = str(Path(grpc_tools.__file__).parent / "_proto")
    protos = sorted(str(p.relative_to(ROOT)) for p in PROTO_DIR.glob("*.proto"))
    args = ["protoc", f"-I{ROOT}", f"-I{include}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", *protos]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    for path in (out_dir / "pdmesh" / "v1").iterdir():
        text = path.read_text()
        text = re.sub(r"^from pdmesh\.v1 import", "from protos.pdmesh.v1 import", text, flags=re.M)
        text = re.sub(r"^import pdmesh\.v1\.", "import protos.pdmesh.v1.", text, flags=re.M)
        path.write_text(text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare instead of writing")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        fresh = {p.name: p.read_text() for p in (Path(tmp) / "pdmesh" / "v1").iterdir()
                 if p.name.endswith(SUFFIXES)}
    current = {p.name: p.read_text() for p in PROTO_DIR.iterdir() if p.name.endswith(SUFFIXES)}
    if args.check:
        stale = sorted(n for n in fresh.keys() | current.keys() if fresh.get(n) != current.get(n))
        if stale:
            print(f"generated code is stale: {stale}; run python protos/compile.py")
            return 1
        print(f"generated code is fresh ({len(fresh)} files)")
        return 0
    for name in current.keys() - fresh.keys():
        (PROTO_DIR / name).unlink()
    for name, text in fresh.items():
        (PROTO_DIR / name).write_text(text)
    print(f"wrote {len(fresh)} files to {PROTO_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
