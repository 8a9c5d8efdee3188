"""200 concurrent streams through one gateway (1 prefill + 1 decode, the built-in tiny
model, as `make run` makes it): every stream must equal the in-process engine's tokens; the gateway's RSS after
the burst must come back within 10% of its level before it; TTFT p50/p99 is reported.

The gateway's RSS (VmRSS of its process) is read when it is fresh, after a warm-up
burst of the same number of streams (2 tokens each: its steady state, the high-water
mark of that many concurrent calls), and after each round once it is idle again. The
10% check compares each round with the level before it; more than one round shows
whether memory grows from burst to burst (a leak), the warm-up's growth what a cold
gateway gains once (`cold_growth`).

    python bench/load.py [--streams 200] [--max-tokens 16] [--rounds 2]
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from pathlib import Path

from bench_mesh import ensure_tiny_model, start_pd_mesh, write_result
from bench_model import ROOT

from common.engine import LLM, SamplingParams  # noqa: E402
from services.security.client_auth import gateway_channel  # noqa: E402

ENGINE = {"num_blocks": 2048, "max_num_seqs": 64, "max_model_len": 1024}
SETTLE_S = 3.0   # for the streams' last messages and cancellations to be processed


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


async def burst(address: str, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], float, str]]:
    import grpc
    from protos.pdmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

    async with gateway_channel(address) as channel:
        await asyncio.wait_for(channel.channel_ready(), 30)
        stub = gateway_pb2_grpc.GatewayStub(channel)

        async def one(ids):
            req = gateway_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(
                max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
            req.prompt_token_ids.ids.extend(ids)
            tokens, ttft, start = [], None, time.perf_counter()
            try:
                async for msg in stub.Generate(req, timeout=300):
                    if ttft is None:
                        ttft = time.perf_counter() - start
                    tokens.extend(msg.token_ids)
            except grpc.aio.AioRpcError as e:
                return tokens, ttft or float("nan"), e.code().name
            return tokens, ttft, ""
        return await asyncio.gather(*(one(p) for p in prompts))


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model-dir", default=str(ROOT / "models" / "tiny-llama"))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "load.json"))
    args = ap.parse_args()
    model = ensure_tiny_model(Path(args.model_dir))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 640) for _ in range(rng.randrange(16, 257))] for _ in range(args.streams)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(str(model), **ENGINE).generate(
        [{"prompt_token_ids": p} for p in prompts], params)]
    mesh = start_pd_mesh(model, ENGINE, "mooncake", prefix="pdmesh-load-")
    address = mesh.gateway_address
    gateway_pid = mesh.services["gateway"].process.pid
    rounds = []
    try:
        fresh = rss_kib(gateway_pid)
        asyncio.run(burst(address, prompts, 2))   # warm-up: channels, routes, buffers of that many calls
        time.sleep(SETTLE_S)
        warm = rss_kib(gateway_pid)
        print(f"warm-up: gateway RSS {fresh / 1024:.1f} -> {warm / 1024:.1f} MiB "
              f"({(warm - fresh) / fresh * 100:+.1f}%, once)", flush=True)
        for r in range(args.rounds):
            before = rss_kib(gateway_pid)
            start = time.perf_counter()
            results = asyncio.run(burst(address, prompts, args.max_tokens))
            wall = time.perf_counter() - start
            time.sleep(SETTLE_S)
            after = rss_kib(gateway_pid)
            exact = sum(tokens == want and not err for (tokens, _, err), want in zip(results, expected))
            errors = sorted({err for _, _, err in results if err})
            ttfts = [t for _, t, err in results if not err]
            row = {"round": r, "streams": args.streams, "exact": exact, "errors": errors,
                   "ttft_p50_s": statistics.median(ttfts) if ttfts else float("nan"),
                   "ttft_p99_s": pct(ttfts, 0.99) if ttfts else float("nan"),
                   "wall_s": wall, "gateway_rss_before_kib": before, "gateway_rss_after_kib": after,
                   "rss_growth": (after - before) / before}
            rounds.append(row)
            print(f"round {r}: {exact}/{args.streams} exact{' errors ' + ','.join(errors) if errors else ''}, "
                  f"TTFT p50 {row['ttft_p50_s'] * 1e3:.0f} ms p99 {row['ttft_p99_s'] * 1e3:.0f} ms, "
                  f"{wall:.1f} s; gateway RSS {before / 1024:.1f} -> {after / 1024:.1f} MiB "
                  f"({row['rss_growth'] * 100:+.1f}%)", flush=True)
    finally:
        mesh.stop()
    ok = all(r["exact"] == args.streams and abs(r["rss_growth"]) <= 0.10 for r in rounds)
    out = {"command": "python bench/load.py " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in
                                                         [("streams", args.streams), ("max_tokens", args.max_tokens),
                                                          ("rounds", args.rounds)]),
           "engine": ENGINE, "gateway_rss_fresh_kib": fresh, "gateway_rss_warm_kib": warm,
           "cold_growth": (warm - fresh) / fresh, "rounds": rounds, "pass": ok,
           "target": "every stream exact; gateway RSS after within 10% of before"}
    return write_result(args.out, out, ok)


if __name__ == "__main__":
    raise SystemExit(main())
