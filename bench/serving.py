"""Online serving, colocated against 1 prefill + 1 decode, side by side in one run:
`pdmesh bench serve` (services/bench) on the bench model (90M fp32 Llama), the same
seeded requests (ShareGPT-like log-normal lengths) at each rate, the two meshes taking
turns (both are up; only the one measured has work), --rounds times.

    python bench/serving.py [--num-prompts 24] [--rates 1,inf] [--rounds 1]

Writes bench/results/serving.json (the command, the machine, every run, and per rate the
ratio 1P+1D / colocated of output tokens/s and of TPOT p50, the median over rounds) and
one PNG per topology. bench/vs_vllm.py measures both against vLLM on the same requests.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys

from bench_mesh import COLOCATED_NODES, PD_NODES, start_pd_mesh
from bench_model import ROOT, ensure_bench_model

from services.bench.machine import machine_info  # noqa: E402
from services.bench.plot import plot_rates  # noqa: E402
from services.bench.serve import ServeConfig, command_line, run_serve_benchmark  # noqa: E402

ENGINE = {"num_blocks": 2048, "max_num_seqs": 64, "max_model_len": 2048}
TOPOLOGIES = {"colocated": COLOCATED_NODES, "1p1d": PD_NODES}
# The 1P+1D meta-server prefills on the decode node while the prefill node's backlog is
# longer than the decode node's by more than this (services/meta_server/router.py); 0 = never.
DEFAULT_PREFILL_QUEUE_THRESHOLD = 1


def topology_meta(name: str, prefill_queue_threshold: int) -> dict:
    """The meta-server fields a topology's mesh starts with."""
    return {"prefill_queue_threshold": prefill_queue_threshold} if name == "1p1d" else {}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--rates", default="1,inf")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--input-len", type=int, default=190)
    ap.add_argument("--output-len", type=int, default=65)
    ap.add_argument("--prefill-queue-threshold", type=int, default=DEFAULT_PREFILL_QUEUE_THRESHOLD,
                    help="1P+1D: the router's meta_server.prefill_queue_threshold (0 = always remote)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "serving.json"))
    args = ap.parse_args()
    rates = tuple(float(r) for r in args.rates.split(","))
    model = ensure_bench_model()
    meshes = {name: start_pd_mesh(model, ENGINE, prefix=f"pdmesh-serving-{name}-", nodes=nodes,
                                  meta=topology_meta(name, args.prefill_queue_threshold))
              for name, nodes in TOPOLOGIES.items()}
    runs: dict[str, list] = {name: [] for name in TOPOLOGIES}
    try:
        for round_index in range(args.rounds):
            for name, mesh in meshes.items():
                print(f"--- round {round_index + 1}: {name}", flush=True)
                out = ROOT / "bench" / "results" / f".serving-{name}-{round_index}.json"
                cfg = ServeConfig(gateway=mesh.gateway_address, rates=rates, num_prompts=args.num_prompts,
                                  random_input_len=args.input_len, random_output_len=args.output_len,
                                  out=str(out), plot=str(out.with_suffix(".png")),
                                  api_key_file=mesh.environ.get("PDMESH_API_KEYS_FILE", ""))
                if asyncio.run(run_serve_benchmark(cfg, argv=sys.argv)) != 0:
                    print(f"{name}: some requests failed", file=sys.stderr)
                    return 1
                runs[name].append(json.loads(out.read_text())["runs"])
                out.unlink()
                out.with_suffix(".png").unlink()
    finally:
        for mesh in meshes.values():
            mesh.stop()
    ratios = {}
    for i, rate in enumerate(rates):
        key = "inf" if math.isinf(rate) else f"{rate:g}"
        per = {name: [rounds[i] for rounds in runs[name]] for name in TOPOLOGIES}
        ratios[key] = {
            "output_throughput_1p1d_over_colocated": statistics.median(
                p["output_throughput"] / c["output_throughput"] for p, c in zip(per["1p1d"], per["colocated"])),
            "tpot_p50_1p1d_over_colocated": statistics.median(
                p["tpot"]["median_ms"] / c["tpot"]["median_ms"] for p, c in zip(per["1p1d"], per["colocated"])),
        }
        print(f"rate {key}: 1P+1D / colocated output tok/s {ratios[key]['output_throughput_1p1d_over_colocated']:.2f}, "
              f"TPOT p50 {ratios[key]['tpot_p50_1p1d_over_colocated']:.2f}")
    report = {"command": command_line(["python", "bench/serving.py", *sys.argv[1:]]), "machine": machine_info(),
              "model": str(model.name),
              "engine": ENGINE, "prefill_queue_threshold_1p1d": args.prefill_queue_threshold,
              "num_prompts": args.num_prompts, "rates": list(map(str, rates)),
              "input_len": args.input_len, "output_len": args.output_len, "runs": runs, "ratios": ratios}
    path = ROOT / "bench" / "results" / "serving.json" if not args.out else args.out
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    for name in TOPOLOGIES:
        plot_rates(runs[name][-1], str(path).replace(".json", f"-{name}.png"), title=f"{model.name}, {name}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
