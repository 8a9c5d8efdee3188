"""`bench/cores.py --serving`: meshes that differ only in how their processes share the
cores, each started with `pdmesh up`'s launcher in turn and measured by `pdmesh bench
serve` on the same seeded requests (bench model, ShareGPT-like lengths):

    colocated-plan      the default plan (on 2 cores: the engine on both, 2 threads,
                        OMP_WAIT_POLICY=PASSIVE; meta-server and gateway share them)
    colocated-1core     engine.cpu_cores = the first core, 1 thread; meta-server and
                        gateway on the other cores (vLLM's CPU default)
    colocated-unplanned plan_cores=False: every process on every core, torch's threads,
                        libgomp's default wait (pdmesh before the budget)
    1p1d-split          the default plan: the cores split between prefill and decode
    1p1d-unplanned      plan_cores=False

The meshes of one topology are up together and take turns (only the one measured has
work), --serving-rounds times, the order reversed every other round; then the next
topology's.
"""
from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
from pathlib import Path

import yaml

from bench_mesh import COLOCATED_NODES, PD_NODES, use_client_key
from bench_model import ROOT, ensure_bench_model

from common.config import mesh_config_from_dict  # noqa: E402
from common.cpu_budget import allowed_cpus, format_cpu_list  # noqa: E402
from services.bench.serve import ServeConfig, run_serve_benchmark  # noqa: E402
from services.cli.launcher import MeshProcesses  # noqa: E402

ENGINE = {"num_blocks": 1024, "max_num_seqs": 32, "max_model_len": 2048}
# name -> nodes, extra engine fields, plan_cores
MESHES = {
    "colocated-plan": (COLOCATED_NODES, {}, True),
    "colocated-1core": (COLOCATED_NODES, {"cpu_cores": format_cpu_list(allowed_cpus()[:1])}, True),
    "colocated-unplanned": (COLOCATED_NODES, {}, False),
    "1p1d-split": (PD_NODES, {}, True),
    "1p1d-unplanned": (PD_NODES, {}, False),
}
# (mesh, against): ratios of output tokens/s and of TPOT / TTFT p50, per rate
COMPARISONS = (("colocated-plan", "colocated-1core"), ("colocated-plan", "colocated-unplanned"),
               ("colocated-1core", "colocated-unplanned"), ("1p1d-split", "1p1d-unplanned"))


def _start(name: str, model: Path) -> MeshProcesses:
    nodes, engine, plan = MESHES[name]
    work = Path(tempfile.mkdtemp(prefix=f"pdmesh-cores-{name}-"))
    raw = {"model": str(model), "engine": {**ENGINE, **engine}, "transfer": {"backend": "mooncake"},
           "meta_server": {"port": 0}, "gateway": {"port": 0},
           "nodes": [{"role": role, "node_id": node_id} for role, node_id in nodes]}
    cfg = work / "mesh.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    mesh = MeshProcesses(str(cfg), mesh_config_from_dict(raw), work / "logs", plan_cores=plan)
    mesh.start()
    use_client_key(mesh)
    return mesh


def _run(mesh: MeshProcesses, name: str, args, rates) -> list[dict]:
    import json
    out = ROOT / "bench" / "results" / f".cores-{name}.json"
    cfg = ServeConfig(gateway=mesh.gateway_address, rates=rates, num_prompts=args.num_prompts,
                      out=str(out), api_key_file=mesh.environ.get("PDMESH_API_KEYS_FILE", ""))
    if asyncio.run(run_serve_benchmark(cfg, argv=sys.argv)) != 0:
        raise RuntimeError(f"{name}: some requests failed")
    runs = json.loads(out.read_text())["runs"]
    out.unlink()
    out.with_suffix(".png").unlink(missing_ok=True)
    return runs


def compare_meshes(args) -> dict:
    """Every mesh of MESHES, args.rounds times; {"runs": {mesh: [per round: runs]},
    "cores": {mesh: {service: cores}}, "ratios": {"A/B": {rate: {...}}}}."""
    model = ensure_bench_model()
    rates = tuple(float(r) for r in args.rates.split(","))
    names = args.meshes.split(",") if args.meshes else list(MESHES)
    runs: dict[str, list] = {name: [] for name in names}
    cores: dict[str, dict] = {}
    for group in (COLOCATED_NODES, PD_NODES):
        members = [n for n in names if MESHES[n][0] == group]
        meshes: dict[str, MeshProcesses] = {}
        try:
            for name in members:
                meshes[name] = _start(name, model)
                cores[name] = {s: svc.cpu.describe() for s, svc in meshes[name].services.items()}
            for round_index in range(args.serving_rounds):
                order = members if round_index % 2 == 0 else members[::-1]
                for name in order:
                    print(f"--- serving round {round_index + 1}: {name}", flush=True)
                    runs[name].append(_run(meshes[name], name, args, rates))
        finally:
            for mesh in meshes.values():
                mesh.stop()
    ratios: dict[str, dict] = {}
    for a, b in (c for c in COMPARISONS if set(c) <= set(names)):
        for i, rate in enumerate(rates):
            pairs = list(zip(runs[a], runs[b]))
            cell = {
                "output_throughput": statistics.median(x[i]["output_throughput"] / y[i]["output_throughput"]
                                                       for x, y in pairs),
                "tpot_p50": statistics.median(x[i]["tpot"]["median_ms"] / y[i]["tpot"]["median_ms"] for x, y in pairs),
                "ttft_p50": statistics.median(x[i]["ttft"]["median_ms"] / y[i]["ttft"]["median_ms"] for x, y in pairs),
            }
            ratios.setdefault(f"{a}/{b}", {})[f"{rate:g}"] = cell
            print(f"{a} / {b} at rate {rate:g}: output tok/s {cell['output_throughput']:.2f}x, "
                  f"TPOT p50 {cell['tpot_p50']:.2f}x, TTFT p50 {cell['ttft_p50']:.2f}x")
    for name, per in runs.items():
        for i, rate in enumerate(rates):
            last = per[-1][i]
            print(f"{name:<20} rate {rate:g}: {last['output_throughput']:6.1f} tok/s, "
                  f"TPOT p50 {last['tpot']['median_ms']:6.1f} ms, TTFT p50 {last['ttft']['median_ms']:7.1f} ms")
    return {"engine": ENGINE, "num_prompts": args.num_prompts, "rates": [f"{r:g}" for r in rates],
            "meshes": {n: {"nodes": m[0], "engine": m[1], "plan_cores": m[2]} for n, m in MESHES.items()},
            "cores": cores, "runs": runs, "ratios": ratios}
