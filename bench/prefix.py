"""Cross-node prefix caching through the kv-store: TTFT of 16 requests sharing a 1,024-token
system prompt (each with its own 64-token tail), cold against warm, in the same run, on a
mesh of 2 prefill nodes + 1 decode node + the kv-store (Mooncake over TCP, bench model).

    cold   16 requests, each with a system prompt of its own: nothing to reuse anywhere
    warm   one request primes the shared system prompt, then the 16 requests share it

Requests go one at a time, round robin over the two prefill nodes. Two meshes:
    mesh        every node keeps its own prefix cache as well (the normal set-up)
    store-only  node prefix caches off: every warm prefix is read from the kv-store by
                a prefill node that never computed it (cross-node reuse alone)

    python bench/prefix.py [--requests 16] [--system 1024] [--tail 64] [--scenarios mesh store-only]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import yaml

from bench_model import ROOT, ensure_bench_model

from common.config import mesh_config_from_dict  # noqa: E402
from bench_mesh import use_client_key  # noqa: E402
from services.cli.launcher import MeshProcesses  # noqa: E402
from services.security.client_auth import gateway_channel  # noqa: E402

ENGINE = {"num_blocks": 1024, "max_num_seqs": 16, "max_model_len": 4096}
VOCAB = 640


async def first_token(address: str, ids: list[int]) -> tuple[float, int]:
    """(TTFT in seconds, cached prompt tokens) of one greedy request."""
    from protos.pdmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
    req = gateway_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(max_tokens=1, ignore_eos=True))
    req.prompt_token_ids.ids.extend(ids)
    async with gateway_channel(address) as ch:
        start = time.perf_counter()
        ttft = None
        async for msg in gateway_pb2_grpc.GatewayStub(ch).Generate(req):
            ttft = ttft or time.perf_counter() - start
            if msg.finish_reason:
                return ttft, msg.usage.cached_prompt_tokens
    raise RuntimeError("stream ended without finish_reason")


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def run_scenario(name: str, model: Path, args, work: Path) -> dict:
    engine = {**ENGINE, "enable_prefix_caching": name == "mesh"}
    raw = {"model": str(model), "engine": engine, "transfer": {"backend": "mooncake"},
           "meta_server": {"port": 0, "policy": "round_robin"}, "gateway": {"port": 0},
           "kv_store": {"port": 0, "capacity_mb": 512},
           "nodes": [{"role": "prefill", "node_id": "prefill-0"}, {"role": "prefill", "node_id": "prefill-1"},
                     {"role": "decode", "node_id": "decode-0"}]}
    cfg = work / f"{name}.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    mesh = MeshProcesses(str(cfg), mesh_config_from_dict(raw), work / f"logs-{name}")
    address = mesh.start()
    use_client_key(mesh)
    rng = random.Random(1)
    tails = [tokens(rng, args.tail) for _ in range(args.requests)]
    system = tokens(rng, args.system)
    try:
        for _ in range(2):  # warm-up: both prefill nodes, nothing shared with what follows
            asyncio.run(first_token(address, tokens(rng, 64)))
        cold = [asyncio.run(first_token(address, tokens(rng, args.system) + t)) for t in tails]
        asyncio.run(first_token(address, system + tokens(rng, args.tail)))  # primes the system prompt
        warm = [asyncio.run(first_token(address, system + t)) for t in tails]
    finally:
        mesh.stop()
    cold_p50 = statistics.median(t for t, _ in cold)
    warm_p50 = statistics.median(t for t, _ in warm)
    result = {"cold_ttft_s": [t for t, _ in cold], "warm_ttft_s": [t for t, _ in warm],
              "cold_cached_tokens": [c for _, c in cold], "warm_cached_tokens": [c for _, c in warm],
              "cold_p50_s": cold_p50, "warm_p50_s": warm_p50, "speedup": cold_p50 / warm_p50}
    print(f"{name:>10}: TTFT p50 cold {cold_p50 * 1e3:7.1f} ms | warm {warm_p50 * 1e3:6.1f} ms | "
          f"{result['speedup']:.1f}x lower | warm cached tokens p50 "
          f"{statistics.median(result['warm_cached_tokens']):.0f} of {args.system + args.tail}", flush=True)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--system", type=int, default=1024)
    ap.add_argument("--tail", type=int, default=64)
    ap.add_argument("--scenarios", nargs="+", default=["mesh", "store-only"], choices=["mesh", "store-only"])
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "prefix.json"))
    args = ap.parse_args()
    model = ensure_bench_model(*([args.model_dir] if args.model_dir else []))
    work = Path(tempfile.mkdtemp(prefix="pdmesh-prefix-"))
    results = {name: run_scenario(name, model, args, work) for name in args.scenarios}
    out = {"requests": args.requests, "system_tokens": args.system, "tail_tokens": args.tail,
           "engine": ENGINE, "scenarios": results, "target": "warm TTFT p50 at least 4x lower than cold"}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
