"""The cpu backend's int8 GEMM for a decode step's rows: pdmesh's AVX512-VNNI GEMV
(kernels/csrc/int8_gemv_cpu.cpp) against oneDNN's `torch._int_mm`, over SmolLM2's 120
projections (30 layers of q/k/v, o, gate/up, down; int8 codes, 107 MB, more than the
caches hold, as in a step), alternating the two round by round in one run; what
kernels/cpu.py chooses for 1-4 rows rests on it.

    python bench/int8_gemv.py [--rows 1,2,4] [--rounds 30] [--out bench/results/int8_gemv.json]

Per row count: the median over rounds of one pass over all 120 weights, the bytes read per
second, and the median of each round's ratio GEMV / _int_mm.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kernels.cpu_extension import cpu_kernels  # noqa: E402
from services.bench.machine import machine_info  # noqa: E402

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))   # SmolLM2 (out, in) per layer
LAYERS = 30


def one_pass(fn, weights: list[torch.Tensor], xs: dict[int, torch.Tensor]) -> float:
    start = time.perf_counter()
    for w in weights:
        fn(xs[w.shape[1]], w)
    return time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "int8_gemv.json"))
    args = ap.parse_args()
    ext = cpu_kernels()
    if ext is None or not ext.int8_gemv_supported():
        raise SystemExit("needs the cpu backend's C++ kernels on a CPU with AVX512-VNNI")
    g = torch.Generator().manual_seed(0)
    weights = [torch.randint(-128, 128, shape, dtype=torch.int8, generator=g) for _ in range(LAYERS) for shape in SHAPES]
    nbytes = sum(w.numel() for w in weights)
    kernels = {"int_mm": lambda x, w: torch._int_mm(x, w.t()), "gemv": lambda x, w: ext.int8_gemv(x, w)}
    report = {"command": " ".join(["python", "bench/int8_gemv.py", *sys.argv[1:]]), "machine": machine_info(),
              "weight_bytes": nbytes, "torch_threads": torch.get_num_threads(), "rows": {}}
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randint(-128, 128, (rows, k), dtype=torch.int8, generator=g) for k in {s[1] for s in SHAPES}}
        for name, fn in kernels.items():
            one_pass(fn, weights, xs)     # warm-up
        times = {name: [] for name in kernels}
        for _ in range(args.rounds):
            for name, fn in kernels.items():
                times[name].append(one_pass(fn, weights, xs))
        ratio = statistics.median(a / b for a, b in zip(times["gemv"], times["int_mm"]))
        entry = {name: {"pass_ms": [t * 1e3 for t in ts], "median_ms": statistics.median(ts) * 1e3,
                        "gb_per_s": nbytes / statistics.median(ts) / 1e9} for name, ts in times.items()}
        entry["gemv_over_int_mm"] = ratio
        report["rows"][rows] = entry
        print(f"{rows} row(s): _int_mm {entry['int_mm']['median_ms']:.2f} ms ({entry['int_mm']['gb_per_s']:.1f} GB/s), "
              f"GEMV {entry['gemv']['median_ms']:.2f} ms ({entry['gemv']['gb_per_s']:.1f} GB/s): {ratio:.2f}x")
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
