"""Where the 1P+1D hand-off goes, hop by hop (issue 14, item 5).

    python bench/handoff.py [--num-prompts 32] [--rate 1] [--out bench/results/handoff.json]

The hand-off is what `pdmesh bench serve` reports for a remotely prefilled request: TTFT
minus the prefill node's queue + compute + transfer (routing, the RPC hops, both nodes'
work around the prefill). This script runs the 1P+1D mesh of bench/vs_vllm.py (the bench
model, a core each, `prefill_queue_threshold` 1) with timelines on (common/timeline.py:
every service appends `time event request` lines; one monotonic clock for the host),
sends the same seeded Poisson workload through `pdmesh bench serve`, and splits each
remotely prefilled request's time to its first token into the segments between
consecutive events: a new gRPC call (client -> gateway, gateway -> meta-server, gateway
-> decode, decode -> prefill), an answer or a stream message on a call already open, or
work inside one process. It also times a bare grpc.aio unary call between two processes
on this machine, back to back and with 5 ms between calls (the gap the mesh's calls
have), to show what a hop costs here with nothing of ours in it.

Writes JSON: per segment p50 / mean / p90 (ms) and its kind, the sums per kind, the
hand-off as the timelines give it (client.first - client.sent - (prefill.answered -
prefill.start)) and as bench serve reported it, and the bare gRPC figures.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench_mesh import start_pd_mesh, write_result
from bench_model import BENCH_MODEL, ROOT, ensure_bench_model
from serving import ENGINE, TOPOLOGIES, topology_meta

from common import timeline  # noqa: E402
from services.bench.machine import machine_info  # noqa: E402
from services.bench.serve import ServeConfig, command_line, run_serve_benchmark  # noqa: E402

# (from, to, kind) in the order a remotely prefilled request meets them (common/timeline.py)
SEGMENTS = [
    ("client.sent", "gateway.in", "new call"),
    ("gateway.in", "gateway.route_sent", "in process"),
    ("gateway.route_sent", "meta.route_in", "new call"),
    ("meta.route_in", "meta.route_out", "in process"),
    ("meta.route_out", "gateway.routed", "answer"),
    ("gateway.routed", "gateway.decode_sent", "in process"),
    ("gateway.decode_sent", "decode.in", "new call"),
    ("decode.in", "decode.admitted", "in process"),
    ("decode.admitted", "decode.prefill_sent", "in process"),
    ("decode.prefill_sent", "prefill.in", "new call"),
    ("prefill.in", "prefill.start", "in process"),
    ("prefill.start", "prefill.answered", "prefill"),
    ("prefill.answered", "decode.prefill_answered", "answer"),
    ("decode.prefill_answered", "decode.committed", "in process"),
    ("decode.committed", "decode.first_out", "in process"),
    ("decode.first_out", "gateway.first_in", "stream message"),
    ("gateway.first_in", "gateway.first_out", "in process"),
    ("gateway.first_out", "client.first", "stream message"),
]
EVENTS = [a for a, _, _ in SEGMENTS] + [SEGMENTS[-1][1]]   # all of timeline.EVENTS but prefill.computed


def stats(values: list[float]) -> dict[str, float]:
    """As services/bench/metrics.py computes them (numpy's linear percentiles)."""
    return {"p50_ms": float(np.percentile(values, 50)), "mean_ms": float(np.mean(values)),
            "p90_ms": float(np.percentile(values, 90))}


def bare_grpc_rtt(calls: int = 300) -> dict[str, dict[str, float]]:
    """A grpc.aio Health check between two processes, back to back and 5 ms apart."""
    code = ("import asyncio, grpc\nfrom grpc_health.v1 import health, health_pb2_grpc\n"
            "async def main():\n    s = grpc.aio.server()\n"
            "    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), s)\n"
            "    print(s.add_insecure_port('127.0.0.1:0'), flush=True)\n    await s.start()\n"
            "    await s.wait_for_termination()\nasyncio.run(main())\n")
    server = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())

        async def run() -> dict[str, dict[str, float]]:
            import grpc
            from grpc_health.v1 import health_pb2, health_pb2_grpc
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
                out = {}
                for name, gap in (("back_to_back", 0.0), ("gap_5ms", 0.005)):
                    times = []
                    for _ in range(calls):
                        start = time.perf_counter()
                        await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
                        times.append((time.perf_counter() - start) * 1e3)
                        if gap:
                            await asyncio.sleep(gap)
                    out[name] = stats(times)
                return out
        return asyncio.run(run())
    finally:
        server.kill()
        server.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--rate", type=float, default=1.0, help="requests/s (Poisson)")
    ap.add_argument("--input-len", type=int, default=190)
    ap.add_argument("--output-len", type=int, default=65)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-borrow-cores", action="store_true",
                    help="keep the decode node on its own core (by default it borrows the idle prefill node's)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "handoff.json"))
    args = ap.parse_args()
    model = ensure_bench_model()
    work = Path(tempfile.mkdtemp(prefix="pdmesh-handoff-"))
    lines = work / "timelines"
    lines.mkdir()
    timeline.record_to(str(lines))
    bare = bare_grpc_rtt()
    print(f"bare grpc.aio unary call: {bare['back_to_back']['p50_ms']:.2f} ms back to back, "
          f"{bare['gap_5ms']['p50_ms']:.2f} ms 5 ms apart (p50)", flush=True)
    mesh = start_pd_mesh(model, ENGINE, prefix="pdmesh-handoff-", nodes=TOPOLOGIES["1p1d"],
                         meta=topology_meta("1p1d", 1), env={"PDMESH_TIMELINE_DIR": str(lines)},
                         borrow_cores=not args.no_borrow_cores)
    try:
        cfg = ServeConfig(gateway=mesh.gateway_address, rates=(args.rate,), num_prompts=args.num_prompts,
                          random_input_len=args.input_len, random_output_len=args.output_len,
                          vocab_size=BENCH_MODEL["vocab_size"], seed=args.seed, out=str(work / "serve.json"),
                          plot="none", api_key_file=mesh.environ.get("PDMESH_API_KEYS_FILE", ""))
        code = asyncio.run(run_serve_benchmark(cfg, argv=sys.argv))
    finally:
        mesh.stop()
    served = json.loads((work / "serve.json").read_text())["runs"][0]
    sent = sorted((r for r in timeline.read(lines).values() if "client.sent" in r), key=lambda r: r["client.sent"])
    measured = sent[cfg.warmup:]   # the warm-up requests go first, one at a time
    complete = [r for r in measured if all(e in r for e in EVENTS)]
    if not complete:
        print("no request was prefilled remotely", file=sys.stderr)
        return 1
    segments, kinds = [], collections.defaultdict(float)
    for a, b, kind in SEGMENTS:
        s = stats([(r[b] - r[a]) * 1e3 for r in complete])
        segments.append({"from": a, "to": b, "kind": kind, **s})
        kinds[kind] += s["p50_ms"]
        print(f"{a:>24} -> {b:<24} {kind:<15} p50 {s['p50_ms']:7.2f}  mean {s['mean_ms']:7.2f}  "
              f"p90 {s['p90_ms']:7.2f} ms")
    handoff = stats([((r["client.first"] - r["client.sent"]) - (r["prefill.answered"] - r["prefill.start"])) * 1e3
                     for r in complete])
    print("p50 sums by kind: " + ", ".join(f"{k} {v:.2f} ms" for k, v in kinds.items() if k != "prefill"))
    print(f"hand-off from the timelines: p50 {handoff['p50_ms']:.2f} ms; as bench serve reports it: "
          f"p50 {served['handoff']['median_ms']:.2f} ms ({served['handoff']['requests']} requests)")
    out = {"command": command_line(["python", "bench/handoff.py", *sys.argv[1:]]), "machine": machine_info(),
           "model": model.name, "rate": args.rate, "borrow_cores": not args.no_borrow_cores, "num_prompts": args.num_prompts,
           "requests_traced": len(complete), "segments": segments,
           "p50_sum_by_kind_ms": dict(kinds), "handoff_from_timelines": handoff,
           "handoff_bench_serve": served["handoff"], "output_throughput": served["output_throughput"],
           "bare_grpc_unary_rtt": bare}
    return write_result(args.out, out, code == 0)


if __name__ == "__main__":
    sys.exit(main())
