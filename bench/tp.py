"""Tensor parallelism on this machine (issue 16): per-rank weight memory and the decode
step at tensor_parallel_size 1 and 2, on the bench model.

    python bench/tp.py [--rounds 3] [--steps 24] [--out bench/results/tp.json] [--only-mesh]

Per TP size: rank 0's parameter bytes (every rank holds the same share), each rank
process's resident memory (VmRSS) once loaded, and the median decode step at batch 1
and batch 8 (greedy, 16-token prompts; one engine per round, the sizes alternating
1, 2, 1, 2, ... so a drifting machine treats both alike). Then the KV push between TP
sizes (p = d = 1, p = d = 2, p = 2d with head-slice writes, and the staged alternative),
measured by `bench/transfer.py --tp` (run here as a child; its JSON embedded under
"kv_push"); and the same pairs through a real mesh (mesh_push: TTFT and the prefill
node's compute and in-flight transfer time of 1,024-token prompts, p2 -> d1 being the
staged push the serving path makes). Writes the JSON and prints a summary.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

from bench_model import BENCH_MODEL, ROOT, ensure_bench_model  # noqa: F401  (puts the repository on sys.path)

from services.bench.machine import machine_info  # noqa: E402


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def decode_steps(engine, batch: int, steps: int, seed: int) -> list[float]:
    """Seconds of each decode step of `batch` requests (their prefill excluded)."""
    from common.engine.sampling_params import SamplingParams
    rng = random.Random(seed)
    for i in range(batch):
        engine.add_request(f"b{batch}-{seed}-{i}", [rng.randrange(3, 600) for _ in range(16)],
                           SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True))
    engine.step()   # the prefill (and first token)
    times = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times


def measure(model: Path, tp: int, steps: int, seed: int) -> dict:
    from common.config import EngineConfig
    from common.engine.llm_engine import LLMEngine
    engine = LLMEngine(EngineConfig(str(model), num_blocks=256, max_model_len=1024,
                                    tensor_parallel_size=tp))
    try:
        out = {"param_mib_per_rank": sum(engine.model.dense_bytes.values()) / 2**20,   # before prepare_linears
               "rss_mib": [rss_mib(os.getpid()), *(rss_mib(p) for p in (engine.tp.pids if engine.tp else []))]}
        for batch in (1, 8):
            times = decode_steps(engine, batch, steps, seed)
            out[f"step_b{batch}_ms"] = statistics.median(times) * 1e3
        return out
    finally:
        engine.close()


def kv_push(repeats: int) -> dict:
    """bench/transfer.py --tp's figures (mooncake tcp, a 4,096-token prompt's KV)."""
    import subprocess
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "transfer_tp.json"
        subprocess.run([sys.executable, str(ROOT / "bench" / "transfer.py"), "--tp", "--repeats", str(repeats),
                        "--out", str(out)], check=True)
        return json.loads(out.read_text())


MESH_PAIRS = (("p2", "d2"), ("p2", "d1"), ("p1", "d1"))


def mesh_push(model: Path, prompt_tokens: int, requests: int) -> dict:
    """Through a real mesh (prefill p2 at TP 2 and p1, decode d2 at TP 2 and d1; mooncake
    tcp; the others drained), per pair: `requests` prompts of prompt_tokens, one at a
    time, 1 output token; medians of the prefill node's own timing (compute, and transfer:
    KV writes still in flight after the first token) and of the client's TTFT. p2 -> d1 is
    the staged push (rank 0 gathers both ranks' heads between steps)."""
    import asyncio
    import yaml

    from bench_mesh import use_client_key
    from common.config import mesh_config_from_dict
    from protos.pdmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc, gateway_pb2, gateway_pb2_grpc, meta_pb2, meta_pb2_grpc
    from services.cli.launcher import MeshProcesses
    from services.security.client_auth import gateway_channel, mesh_channel
    from services.security.credentials import load_credentials

    import tempfile
    work = Path(tempfile.mkdtemp(prefix="pdmesh-tp-push-"))
    nodes = [{"role": "prefill", "node_id": "p2", "engine": {"tensor_parallel_size": 2}},
             {"role": "prefill", "node_id": "p1"},
             {"role": "decode", "node_id": "d2", "engine": {"tensor_parallel_size": 2}},
             {"role": "decode", "node_id": "d1"}]
    raw = {"model": str(model), "engine": {"num_blocks": 512, "max_model_len": 2048},
           "transfer": {"backend": "mooncake", "kv_push": "layerwise"},
           "meta_server": {"port": 0, "local_prefill_max_tokens": 0}, "gateway": {"port": 0}, "nodes": nodes}
    (work / "mesh.yaml").write_text(yaml.safe_dump(raw))
    mesh = MeshProcesses(str(work / "mesh.yaml"), mesh_config_from_dict(raw), work / "logs", plan_cores=False)
    mesh.start(timeout_s=300)
    use_client_key(mesh)
    rng = random.Random(3)
    out = {}

    async def one(prompt: list[int]) -> tuple[float, common_pb2.PrefillTiming]:
        async with gateway_channel(mesh.gateway_address) as ch:
            req = gateway_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(max_tokens=1, ignore_eos=True))
            req.prompt_token_ids.ids.extend(prompt)
            start = time.perf_counter()
            async for msg in gateway_pb2_grpc.GatewayStub(ch).Generate(req):
                return time.perf_counter() - start, msg.prefill_timing

    creds = load_credentials(mesh.mesh.security, environ=mesh.environ, require_identity=False)

    def p2_stats():
        with mesh_channel(mesh.services["p2"].address, creds, sync=True) as ch:
            return engine_pb2_grpc.PrefillStub(ch).GetEngineStats(engine_pb2.EngineStatsRequest(), timeout=5)

    try:
        for prefill, decode in MESH_PAIRS:
            with mesh.admin_channel() as ch:
                admin = meta_pb2_grpc.MetaAdminStub(ch)
                for node_id in (n["node_id"] for n in nodes):
                    if node_id in (prefill, decode):
                        admin.UndrainNode(meta_pb2.UndrainNodeRequest(node_id=node_id), timeout=5)
                    else:
                        admin.DrainNode(meta_pb2.DrainNodeRequest(node_id=node_id), timeout=5)
            before = p2_stats()
            runs = [asyncio.run(one([rng.randrange(3, 600) for _ in range(prompt_tokens)]))
                    for _ in range(requests + 1)][1:]      # the first warms the pair up
            after = p2_stats()
            assert all(t.remote for _, t in runs), f"{prefill} -> {decode}: not every prefill was remote"
            out[f"{prefill}->{decode}"] = {
                "ttft_ms": statistics.median(r[0] for r in runs) * 1e3,
                "compute_ms": statistics.median(r[1].compute_ms for r in runs),
                "transfer_ms": statistics.median(r[1].transfer_ms for r in runs),
                # which path p2 took: its worker rank's own writes, blocks staged via rank 0
                "p2_rank_bytes_written": after.rank_bytes_written - before.rank_bytes_written,
                "p2_kv_blocks_staged": after.kv_blocks_staged - before.kv_blocks_staged}
            print(f"{prefill} -> {decode}: " + ", ".join(f"{k} {v:.1f}" for k, v in out[f'{prefill}->{decode}'].items()),
                  flush=True)
    finally:
        mesh.stop()
    return {"prompt_tokens": prompt_tokens, "requests": requests, "pairs": out}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=24, help="decode steps per batch size")
    ap.add_argument("--push-repeats", type=int, default=9, help="rounds of the KV push cases")
    ap.add_argument("--mesh-prompt-tokens", type=int, default=1024, help="the mesh pairs' prompt length")
    ap.add_argument("--mesh-requests", type=int, default=5, help="prompts per mesh pair (one at a time)")
    ap.add_argument("--only-mesh", action="store_true", help="measure the mesh pairs alone (print, no JSON)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "tp.json"))
    args = ap.parse_args()
    model = ensure_bench_model()
    if args.only_mesh:
        print(json.dumps(mesh_push(model, args.mesh_prompt_tokens, args.mesh_requests), indent=1))
        return 0
    rounds = []
    for r in range(args.rounds):
        for tp in (1, 2):
            result = measure(model, tp, args.steps, seed=r)
            rounds.append({"round": r, "tp": tp, **result})
            print(f"round {r} tp {tp}: params/rank {result['param_mib_per_rank']:.0f} MiB, RSS "
                  f"{', '.join(f'{m:.0f}' for m in result['rss_mib'])} MiB, step b1 {result['step_b1_ms']:.1f} ms, "
                  f"b8 {result['step_b8_ms']:.1f} ms", flush=True)
    medians = {}
    for tp in (1, 2):
        mine = [x for x in rounds if x["tp"] == tp]
        medians[tp] = {k: statistics.median(x[k] for x in mine) for k in ("param_mib_per_rank", "step_b1_ms", "step_b8_ms")}
        medians[tp]["rss_mib_per_rank"] = [statistics.median(x["rss_mib"][i] for x in mine) for i in range(tp)]
    ratios = {k: medians[2][k] / medians[1][k] for k in ("param_mib_per_rank", "step_b1_ms", "step_b8_ms")}
    report = {"command": " ".join(["python", "bench/tp.py", *sys.argv[1:]]), "machine": machine_info(),
              "model": model.name, "model_sizes": BENCH_MODEL, "rounds": rounds, "medians": medians, "ratios_tp2_over_tp1": ratios,
              "kv_push": kv_push(args.push_repeats),
              "mesh_push": mesh_push(model, args.mesh_prompt_tokens, args.mesh_requests)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"TP 2 / TP 1: params per rank {ratios['param_mib_per_rank']:.2f}x, decode step b1 "
          f"{ratios['step_b1_ms']:.2f}x, b8 {ratios['step_b8_ms']:.2f}x")
    push = report["kv_push"]["results"]
    print("KV push, x the p=d=1 push's GB/s: " + ", ".join(
        f"{case} {r['ratio_to_p1d1']:.3f}x ({r['writes_per_block_per_rank'][0]:g} writes/block)" for case, r in push.items())
          + f"; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
