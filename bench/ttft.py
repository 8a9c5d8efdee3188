"""TTFT through the gateway on a 1-prefill + 1-decode mesh against the in-process engine,
same prompts, same run, one request at a time; the mesh's TTFT is broken down into
queueing, prefill compute and KV transfer (measured by the prefill node) and the rest
(RPC, routing, scheduling hops).

The client keeps one channel to the gateway, connected before anything is timed, as any
serving client does (grpc channels are long-lived and carry many calls): TTFT is from
sending the request to its first token, without TCP/HTTP2 connection setup.

    python bench/ttft.py [--lengths 128 512 1024] [--repeats 6] [--transfer mooncake]

--compare-push: the KV push layer by layer against chunk by chunk (transfer.kv_push,
services/prefill/kv_push.py), two such meshes side by side, the modes alternating
request by request (ABBA) on the same prompts, whose first tokens must agree. By default
each prompt is one prefill chunk (max_num_batched_tokens 4096), so the per-chunk mode's
transfer time (first token sampled -> every write acknowledged) is the whole push after
the compute: the transfer's own duration. Per prompt length: the exposed transfer in
each mode, and what the layerwise push adds to TTFT against compute alone, paired per
prompt: layerwise TTFT - (per-chunk TTFT - per-chunk transfer), as a fraction of the
transfer's own duration.

    python bench/ttft.py --compare-push [--lengths 1024 4095] [--repeats 6]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from pathlib import Path

from bench_mesh import start_pd_mesh
from bench_model import ROOT, ensure_bench_model

from common.engine import LLM, SamplingParams  # noqa: E402
from services.security.client_auth import gateway_channel  # noqa: E402

ENGINE = {"num_blocks": 1024, "max_num_seqs": 16, "max_model_len": 4096}


class Client:
    """One persistent channel to the gateway, on its own event loop, ready before use."""

    def __init__(self, address: str):
        self.loop = asyncio.new_event_loop()
        self.loop.run_until_complete(self._connect(address))

    async def _connect(self, address: str) -> None:
        from protos.pdmesh.v1 import gateway_pb2_grpc
        self.channel = gateway_channel(address)
        await asyncio.wait_for(self.channel.channel_ready(), 30)
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)

    def first_token(self, ids: list[int]):
        return self.loop.run_until_complete(self._first_token(ids))

    async def _first_token(self, ids: list[int]):
        from protos.pdmesh.v1 import common_pb2, gateway_pb2
        req = gateway_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(max_tokens=1, ignore_eos=True))
        req.prompt_token_ids.ids.extend(ids)
        start = time.perf_counter()
        async for msg in self.stub.Generate(req):
            return time.perf_counter() - start, msg.prefill_timing, list(msg.token_ids)

    def close(self) -> None:
        self.loop.run_until_complete(self.channel.close())
        self.loop.close()


def p50(values):
    return statistics.median(values) if values else float("nan")


PUSH_MODES = ("chunk", "layerwise")


# a 4k-token prompt runs for a minute on one shared core: no deadline or stall check may fire
SLOW_TIMEOUTS = {"prefill_s": 900.0, "request_s": 1800.0, "stall_s": 600.0}


def start_push_mesh(model, engine: dict, transfer: str, mode: str):
    """bench_mesh.start_pd_mesh with SLOW_TIMEOUTS, whose prefill node pushes KV in `mode`
    (transfer.kv_push)."""
    return start_pd_mesh(model, engine, transfer, prefix=f"pdmesh-ttft-{mode}-", kv_push=mode,
                         timeouts=SLOW_TIMEOUTS)


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds the process has used so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def compare_push(args, model) -> int:
    engine = {**ENGINE, "max_num_batched_tokens": args.max_num_batched_tokens}
    rng = random.Random(0)
    meshes, clients = {}, {}
    results = {}
    try:
        for mode in PUSH_MODES:
            meshes[mode] = start_push_mesh(model, engine, args.transfer, mode)
            clients[mode] = Client(meshes[mode].gateway_address)
        for mode in PUSH_MODES:   # warm-up: every length once, untimed
            for n in [64, *args.lengths]:
                clients[mode].first_token([rng.randrange(3, 640) for _ in range(n)])
        for n in args.lengths:
            rows = {mode: [] for mode in PUSH_MODES}
            for r in range(args.repeats):
                ids = [rng.randrange(3, 640) for _ in range(n)]
                order = PUSH_MODES if r % 4 in (0, 3) else PUSH_MODES[::-1]   # ABBA
                tokens = {}
                for mode in order:
                    prefill = meshes[mode].services["prefill-0"].process.pid
                    cpu = process_cpu_s(prefill)
                    ttft, timing, tokens[mode] = clients[mode].first_token(ids)
                    rows[mode].append(dict(mesh_s=ttft, queue_s=timing.queue_ms / 1e3,
                                           compute_s=timing.compute_ms / 1e3,
                                           transfer_s=timing.transfer_ms / 1e3,
                                           prefill_cpu_s=process_cpu_s(prefill) - cpu))
                assert tokens["chunk"] == tokens["layerwise"], "the push modes' first tokens differ"
            results[n] = summarize(rows)
            s, lw, pc = results[n], results[n]["layerwise"], results[n]["chunk"]
            print(f"prompt {n:>5}: TTFT per-chunk {pc['mesh_s'] * 1e3:8.1f} ms (transfer {pc['transfer_s'] * 1e3:6.1f}) | "
                  f"layerwise {lw['mesh_s'] * 1e3:8.1f} ms (transfer {lw['transfer_s'] * 1e3:6.1f}) | "
                  f"ratio {s['ttft_ratio']:.3f} | exposed {s['exposed_fraction']:.3f} | "
                  f"added {s['added_s'] * 1e3:+.1f} ms = {s['added_fraction']:+.2f} of the transfer | "
                  f"prefill CPU {s['prefill_cpu_extra_s'] * 1e3:+.0f} ms", flush=True)
    finally:
        for client in clients.values():
            client.close()
        for mesh in meshes.values():
            mesh.stop()
    out = {"transfer": args.transfer, "engine": engine, "modes": list(PUSH_MODES), "repeats": args.repeats,
           "order": "ABBA per prompt; both meshes up side by side", "lengths": results,
           "target": "layerwise: the KV transfer adds at most 10% of its own duration to TTFT on a 4k prompt",
           "cores": os.cpu_count()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")
    return 0


def summarize(rows: dict[str, list[dict]]) -> dict:
    """p50 of each mode's timings; the layerwise/per-chunk TTFT ratio; the exposed transfer
    (layerwise over per-chunk transfer time); added_s: p50 over prompts of layerwise TTFT -
    (per-chunk TTFT - per-chunk transfer), i.e. against compute alone; added_fraction:
    added_s over the p50 per-chunk transfer (the transfer's own duration);
    prefill_cpu_extra_s: p50 over prompts of the prefill process's CPU seconds, layerwise
    minus per-chunk (less sensitive to a shared machine than wall time)."""
    lw, pc = rows["layerwise"], rows["chunk"]
    out = {mode: {k: p50([r[k] for r in rows[mode]]) for k in rows[mode][0]} for mode in rows}
    own = out["chunk"]["transfer_s"]
    out["ttft_ratio"] = out["layerwise"]["mesh_s"] / out["chunk"]["mesh_s"]
    out["ttft_ratio_paired"] = p50([a["mesh_s"] / b["mesh_s"] for a, b in zip(lw, pc)])
    out["exposed_fraction"] = out["layerwise"]["transfer_s"] / own
    out["added_s"] = p50([a["mesh_s"] - (b["mesh_s"] - b["transfer_s"]) for a, b in zip(lw, pc)])
    out["added_fraction"] = out["added_s"] / own
    out["prefill_cpu_extra_s"] = p50([a["prefill_cpu_s"] - b["prefill_cpu_s"] for a, b in zip(lw, pc)])
    out["runs"] = rows
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=None,
                    help="prompt lengths (default 128 512 1024; with --compare-push 1024 4095)")
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--transfer", default="mooncake", choices=["mooncake", "grpc"])
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--out", default=None, help="default bench/results/ttft.json "
                    "(--compare-push: bench/results/ttft_layerwise.json)")
    ap.add_argument("--compare-push", action="store_true", help="layerwise against per-chunk KV push")
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096,
                    help="--compare-push: the prefill chunk (4096: a 4k prompt in one chunk)")
    args = ap.parse_args()
    model = ensure_bench_model(*( [args.model_dir] if args.model_dir else []))
    results_dir = ROOT / "bench" / "results"
    if args.compare_push:
        args.lengths = args.lengths or [1024, 4095]
        args.out = args.out or str(results_dir / "ttft_layerwise.json")
        return compare_push(args, model)
    args.lengths = args.lengths or [128, 512, 1024]
    args.out = args.out or str(results_dir / "ttft.json")
    vocab = 640
    rng = random.Random(0)
    llm = LLM(str(model), **ENGINE)
    mesh = start_pd_mesh(model, ENGINE, args.transfer, prefix="pdmesh-ttft-")
    address = mesh.gateway_address
    results = {}
    client = None
    try:
        client = Client(address)
        client.first_token([5] * 64)  # warm-up
        llm.generate({"prompt_token_ids": [5] * 64}, SamplingParams(max_tokens=1))
        for n in args.lengths:
            rows = []
            for _ in range(args.repeats):
                ids = [rng.randrange(3, vocab) for _ in range(n)]
                start = time.perf_counter()
                local = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, temperature=0.0))
                inproc = time.perf_counter() - start
                ttft, timing, tok = client.first_token(ids)
                assert tok == local[0].outputs[0].token_ids, "mesh and in-process first tokens differ"
                parts = (timing.queue_ms + timing.compute_ms + timing.transfer_ms) / 1e3
                rows.append(dict(inproc_s=inproc, mesh_s=ttft, queue_s=timing.queue_ms / 1e3,
                                 compute_s=timing.compute_ms / 1e3, transfer_s=timing.transfer_ms / 1e3,
                                 overhead_s=ttft - parts, remote=timing.remote))
            summary = {k: p50([r[k] for r in rows]) for k in rows[0] if k != "remote"}
            summary["overhead_vs_inproc_s"] = p50([r["mesh_s"] - r["transfer_s"] - r["inproc_s"] for r in rows])
            results[n] = {"p50": summary, "runs": rows}
            print(f"prompt {n:>5}: in-process {summary['inproc_s'] * 1e3:7.1f} ms | mesh {summary['mesh_s'] * 1e3:7.1f} ms "
                  f"= queue {summary['queue_s'] * 1e3:.1f} + compute {summary['compute_s'] * 1e3:.1f} + "
                  f"transfer {summary['transfer_s'] * 1e3:.1f} + overhead {summary['overhead_s'] * 1e3:.1f} ms "
                  f"(mesh - transfer - in-process: {summary['overhead_vs_inproc_s'] * 1e3:.1f} ms)", flush=True)
    finally:
        if client is not None:
            client.close()
        mesh.stop()
    out = {"transfer": args.transfer, "engine": ENGINE, "lengths": results,
           "target": "overhead besides the transfer <= 10 ms at p50"}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
