"""The fault matrix (tests/faults/) as a benchmark: runs the suite, which prints the
table (case, completed, migrated, failed, max extra latency) and writes it to
bench/results/faults.json.

    python bench/faults.py [extra pytest arguments, e.g. -m "not long_fault"]
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "faults.json"


def main() -> int:
    env = {**os.environ, "PDMESH_FAULTS_JSON": str(OUT)}
    cmd = [sys.executable, "-m", "pytest", "tests/faults", "-p", "no:cacheprovider", "-q", *sys.argv[1:]]
    return subprocess.call(cmd, cwd=ROOT, env=env)


if __name__ == "__main__":
    raise SystemExit(main())
