"""The flake budget: the integration and fault tiers, N times, each in a fresh clone of
this repository's HEAD (nothing a run leaves, in the tree or in the caches of a mesh, is
seen by the next), optionally beside a competing CPU load (one busy process per core)
and in a shuffled order. Prints each failure and error with its test id, then a line per
run; exits 1 if any run had one.

    python tests/repeat.py --runs 5 [--load] [--shuffle] [--tiers integration,faults]
                           [--json OUT] [-- extra pytest arguments, e.g. -m 'not long_fault']
    make test-repeat N=5 [LOAD=1] [SHUFFLE=1]

A clone holds what is committed: uncommitted changes are not tested. The clones run on
this checkout's virtual environment (the interpreter running this script), whose editable
install yields to the clone's own modules (the clone is the working directory).
A pytest ERROR (a fixture that failed) is reported like a failure.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUSY_LOOP = "while True: pass"


@dataclass
class RunResult:
    run: int
    commit: str
    seconds: float
    passed: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    exit_code: int = 0
    problems: list[str] = field(default_factory=list)   # "FAILED|ERROR test id: first line"

    def line(self) -> str:
        return (f"run {self.run}: {self.commit[:10]} {self.seconds:7.0f} s  passed {self.passed}, "
                f"failed {self.failed}, errors {self.errors}, skipped {self.skipped} (pytest exit {self.exit_code})")


def head_commit() -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout.strip()


def read_junit(path: Path, result: RunResult) -> None:
    """Counts and problems from pytest's JUnit XML (a run that died early leaves none)."""
    if not path.exists():
        result.problems.append(f"ERROR (no report: pytest exited {result.exit_code})")
        result.errors += 1
        return
    for case in ET.parse(path).getroot().iter("testcase"):
        test_id = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        kinds = {child.tag: child for child in case}
        if "failure" in kinds or "error" in kinds:
            tag = "failure" if "failure" in kinds else "error"
            result.failed += tag == "failure"
            result.errors += tag == "error"
            message = (kinds[tag].get("message") or "").strip().splitlines()
            result.problems.append(f"{'FAILED' if tag == 'failure' else 'ERROR'} {test_id}: "
                                   f"{message[0] if message else ''}"[:400])
        elif "skipped" in kinds:
            result.skipped += 1
        else:
            result.passed += 1


def start_load() -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(os.cpu_count() or 1)]


def one_run(i: int, commit: str, tiers: list[str], args: argparse.Namespace, workdir: Path) -> RunResult:
    clone = workdir / f"clone-{i}"
    subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(ROOT), str(clone)], check=True)
    subprocess.run(["git", "checkout", "--quiet", commit], cwd=clone, check=True)
    junit = workdir / f"run-{i}.xml"
    cmd = [sys.executable, "-m", "pytest", *[f"tests/{t}" for t in tiers], "-p", "no:cacheprovider", "-q",
           "-rfE", f"--junitxml={junit}", *(["--random-order"] if args.shuffle else []), *args.pytest_args]
    load = start_load() if args.load else []
    start = time.monotonic()
    try:
        with open(workdir / f"run-{i}.log", "wb") as log:
            code = subprocess.call(cmd, cwd=clone, stdout=log, stderr=subprocess.STDOUT)
    finally:
        for p in load:
            p.kill()
            p.wait()
    result = RunResult(i, commit, time.monotonic() - start, exit_code=code)
    read_junit(junit, result)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tiers", default="integration,faults", help="folders under tests/, comma-separated")
    parser.add_argument("--load", action="store_true", help="one busy process per core beside each run")
    parser.add_argument("--shuffle", action="store_true", help="pytest-random-order: tests and modules shuffled")
    parser.add_argument("--json", help="write every run's counts and problems here")
    parser.add_argument("--workdir", help="keep the clones and logs here (default: a temporary folder, removed)")
    parser.add_argument("pytest_args", nargs="*", help="after --: passed to pytest")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs must be 1 or more, got {args.runs}")
    tiers = [t for t in args.tiers.split(",") if t]
    unknown = [t for t in tiers if not (ROOT / "tests" / t).is_dir()]
    if unknown:
        parser.error(f"--tiers: no folder tests/{unknown[0]}; allowed: unit, kernels, integration, faults")
    commit = head_commit()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    if dirty:
        print("repeat: uncommitted changes are not in a fresh clone; testing HEAD", commit[:10])
    results = []
    with tempfile.TemporaryDirectory(prefix="pdmesh-repeat-") as tmp:
        workdir = Path(args.workdir or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        for i in range(1, args.runs + 1):
            print(f"repeat: run {i}/{args.runs} of tests/{{{','.join(tiers)}}} at {commit[:10]}"
                  f"{' beside a load of ' + str(os.cpu_count()) + ' busy processes' if args.load else ''}"
                  f"{', shuffled' if args.shuffle else ''}", flush=True)
            result = one_run(i, commit, tiers, args, workdir)
            for problem in result.problems:
                print(f"  {problem}", flush=True)
            print(f"  {result.line()}", flush=True)
            results.append(result)
    print("\n".join(["repeat: summary", *(r.line() for r in results)]))
    if args.json:
        Path(args.json).write_text(json.dumps({"tiers": tiers, "load": args.load, "shuffle": args.shuffle,
                                               "runs": [asdict(r) for r in results]}, indent=2))
    return 1 if any(r.failed or r.errors or r.exit_code not in (0, 5) for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
