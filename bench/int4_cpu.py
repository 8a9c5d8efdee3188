"""W4A16 on a CPU: torch's packed int4 matmul (`_weight_int4pack_mm_for_cpu`) against
oneDNN on the weight dequantized once (float32, packed), on SmolLM2's projection shapes,
alternating the two in one run; what kernels/cpu.py chooses rests on it.

    python bench/int4_cpu.py [--rows 1,2,8,64,512] [--repeat 20] [--out bench/results/int4_cpu.json]
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

from services.bench.machine import machine_info  # noqa: E402

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}   # SmolLM2 (out, in)
GROUP = 64


def timed(fn, repeat: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,8,64,512")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "int4_cpu.json"))
    args = ap.parse_args()
    report = {"command": " ".join(["python", "bench/int4_cpu.py", *sys.argv[1:]]), "machine": machine_info(),
              "threads": torch.get_num_threads(), "group_size": GROUP, "runs": []}
    g = torch.Generator().manual_seed(0)
    for name, (n, k) in SHAPES.items():
        codes = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=g)
        scale = torch.rand(n, k // GROUP, generator=g) * 0.01
        packed = torch._convert_weight_to_int4pack_for_cpu(codes, 1)
        scales_and_zeros = torch.stack([scale.t(), torch.zeros_like(scale.t())], -1).contiguous()
        dense = torch.ops.mkldnn._reorder_linear_weight((codes - 8).float() * scale.repeat_interleave(GROUP, 1), None)
        for rows in map(int, args.rows.split(",")):
            x = torch.randn(rows, k, generator=g)
            int4, onednn = [], []
            for _ in range(3):      # alternating
                int4.append(timed(lambda: torch._weight_int4pack_mm_for_cpu(x, packed, GROUP, scales_and_zeros),
                                  args.repeat))
                onednn.append(timed(lambda: torch.ops.mkldnn._linear_pointwise(x, dense, None, "none", [], ""),
                                    args.repeat))
            run = {"shape": name, "out": n, "in": k, "rows": rows, "int4_ms": statistics.median(int4) * 1e3,
                   "onednn_fp32_ms": statistics.median(onednn) * 1e3}
            run["int4_over_onednn"] = run["int4_ms"] / run["onednn_fp32_ms"]
            report["runs"].append(run)
            print(f"{name:8s} rows {rows:4d}: int4 {run['int4_ms']:8.3f} ms, oneDNN fp32 {run['onednn_fp32_ms']:7.3f} ms"
                  f" ({run['int4_over_onednn']:.1f}x)")
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
