"""Oversized requests against one gateway (1 prefill + 1 decode, the built-in tiny model,
as `make run` makes it), with the default limits: how fast a 10 MB prompt is refused, and
whether 8 concurrent streams keep getting tokens meanwhile.

Each phase starts 8 fresh greedy streams, waits until every one has its first token, then
runs its load and measures, per stream, the longest gap between two messages inside the
phase's window (its start and end count as points while the stream runs). The phases run
--rounds times, in turn; the baseline is the host's own noise (a 2-core machine shared
with other work shows gaps of 100-300 ms with no load at all):

    baseline      no load, WINDOW_S: the mesh's own cadence on this host
    refuse_10mb   --repeats 10 MB text prompts, one after the other (refused by
                  limits.max_prompt_bytes before any work)
    ids_20mb      --repeats / 4 prompts of 10M token ids (20 MB), refused by
                  limits.max_prompt_token_ids (read off the wire, when the gateway
                  registers its handlers with services/gateway/wire.py; else after parsing)
    prompt_1mb    a text prompt just under limits.max_prompt_bytes (tokenized in the
                  gateway's tokenizer pool, then refused by max_model_len) and a Tokenize
                  of the same text, at once

Targets: a 10 MB prompt refused within 100 ms (p50 over every refusal); no token gap
above 200 ms in any phase (the median over rounds of each round's longest gap; the worst
is reported too).

    python bench/gateway_dos.py [--streams 8] [--repeats 20] [--rounds 3]
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import statistics
import time
from pathlib import Path

from bench_mesh import ensure_tiny_model, start_pd_mesh, write_result
from bench_model import ROOT

from common.config import LimitsConfig  # noqa: E402
from services.security.client_auth import gateway_channel  # noqa: E402

ENGINE = {"num_blocks": 2048, "max_num_seqs": 64, "max_model_len": 1024}
WINDOW_S = 2.0
TEN_MB = 10 << 20
REFUSAL_TARGET_S = 0.100
GAP_TARGET_S = 0.200


def text_of(num_bytes: int) -> str:
    return ("the quick brown fox jumps over the lazy dog; " * (num_bytes // 40 + 1))[:num_bytes]


async def phase(stub, num_streams: int, load) -> dict:
    """Run `load()` (-> dict of its own numbers) while num_streams streams run."""
    import grpc
    from protos.pdmesh.v1 import common_pb2, gateway_pb2
    rng = random.Random(0)
    arrivals: list[list[float]] = [[] for _ in range(num_streams)]
    finished = [False] * num_streams

    async def stream(i: int) -> None:
        req = gateway_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(
            max_tokens=ENGINE["max_model_len"] - 40, temperature=0.0, ignore_eos=True))
        req.prompt_token_ids.ids.extend(rng.randrange(3, 640) for _ in range(32))
        try:
            async for _ in stub.Generate(req, timeout=300):
                arrivals[i].append(time.perf_counter())
            finished[i] = True
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                raise

    tasks = [asyncio.ensure_future(stream(i)) for i in range(num_streams)]
    while not all(arrivals):
        await asyncio.sleep(0.005)
    start = time.perf_counter()
    result = await load()
    end = time.perf_counter()
    live_at_end = [not f for f in finished]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    gaps = []
    for ts, live in zip(arrivals, live_at_end):
        points = [start, *(t for t in ts if start < t < end), *([end] if live else [])]
        gaps.append(max((b - a for a, b in zip(points, points[1:])), default=0.0))
    return {**result, "window_s": end - start, "max_token_gap_s": max(gaps, default=0.0),
            "median_stream_max_gap_s": statistics.median(gaps) if gaps else 0.0,
            "streams_alive_at_end": sum(live_at_end)}


async def run(address: str, num_streams: int, repeats: int, rounds: int) -> dict:
    import grpc
    from protos.pdmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
    limits = LimitsConfig()
    async with gateway_channel(address, options=[("grpc.max_send_message_length", 64 << 20),
                                                 ("grpc.max_receive_message_length", 64 << 20)]) as channel:
        await asyncio.wait_for(channel.channel_ready(), 30)
        stub = gateway_pb2_grpc.GatewayStub(channel)
        huge = gateway_pb2.GenerateRequest(prompt=text_of(TEN_MB),
                                           sampling=common_pb2.SamplingParams(max_tokens=4)).SerializeToString()
        send_huge = channel.unary_stream("/pdmesh.v1.Gateway/Generate", request_serializer=bytes,
                                         response_deserializer=gateway_pb2.GenerateResponse.FromString)
        allowed_text = text_of(limits.max_prompt_bytes - 1024)
        many_ids = gateway_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(max_tokens=4))
        many_ids.prompt_token_ids.ids.extend([500] * 10_000_000)
        many_ids = many_ids.SerializeToString()

        async def nothing() -> dict:
            await asyncio.sleep(WINDOW_S)
            return {}

        async def refuse(data: bytes, num: int) -> dict:
            latencies, codes = [], set()
            for _ in range(num):
                start = time.perf_counter()
                try:
                    async for _ in send_huge(data, timeout=60):
                        pass
                    codes.add("OK")
                except grpc.aio.AioRpcError as e:
                    codes.add(e.code().name)
                latencies.append(time.perf_counter() - start)
            return {"requests": num, "codes": sorted(codes),
                    "refusal_p50_s": statistics.median(latencies), "refusal_max_s": max(latencies)}

        async def refuse_10mb() -> dict:
            return await refuse(huge, repeats)

        async def ids_20mb() -> dict:
            return await refuse(many_ids, max(repeats // 4, 1))

        async def prompt_1mb() -> dict:
            async def generate():
                start = time.perf_counter()
                try:
                    async for _ in stub.Generate(gateway_pb2.GenerateRequest(
                            prompt=allowed_text, sampling=common_pb2.SamplingParams(max_tokens=4)), timeout=60):
                        pass
                    code = "OK"
                except grpc.aio.AioRpcError as e:
                    code = e.code().name
                return time.perf_counter() - start, code

            async def tokenize():
                start = time.perf_counter()
                reply = await stub.Tokenize(gateway_pb2.TokenizeRequest(text=allowed_text), timeout=60)
                return time.perf_counter() - start, len(reply.token_ids)

            (gen_s, gen_code), (tok_s, num_ids) = await asyncio.gather(generate(), tokenize())
            return {"prompt_bytes": len(allowed_text), "generate_s": gen_s, "generate_code": gen_code,
                    "tokenize_s": tok_s, "tokenize_ids": num_ids}

        loads = {"baseline": nothing, "refuse_10mb": refuse_10mb, "ids_20mb": ids_20mb, "prompt_1mb": prompt_1mb}
        results: dict[str, list[dict]] = {name: [] for name in loads}
        for _ in range(rounds):
            for name, load in loads.items():
                results[name].append(await phase(stub, num_streams, load))
        return results


def summary(name: str, rounds: list[dict]) -> dict:
    gaps = [r["max_token_gap_s"] for r in rounds]
    out = {"rounds": rounds, "max_token_gap_s_median": statistics.median(gaps), "max_token_gap_s_worst": max(gaps)}
    if name in ("refuse_10mb", "ids_20mb"):
        out["codes"] = sorted({c for r in rounds for c in r["codes"]})
        out["refusal_p50_s"] = statistics.median(r["refusal_p50_s"] for r in rounds)
        out["refusal_max_s"] = max(r["refusal_max_s"] for r in rounds)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=20, help="10 MB prompts per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model-dir", default=str(ROOT / "models" / "tiny-llama"))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "gateway_dos.json"))
    args = ap.parse_args()
    model = ensure_tiny_model(Path(args.model_dir))
    mesh = start_pd_mesh(model, ENGINE, "mooncake", prefix="pdmesh-dos-")
    try:
        results = asyncio.run(run(mesh.gateway_address, args.streams, args.repeats, args.rounds))
    finally:
        mesh.stop()
    phases = {name: summary(name, rounds) for name, rounds in results.items()}
    refusal = phases["refuse_10mb"]
    ok = (refusal["codes"] == ["INVALID_ARGUMENT"] and refusal["refusal_p50_s"] <= REFUSAL_TARGET_S
          and all(p["max_token_gap_s_median"] <= GAP_TARGET_S for p in phases.values()))
    for name, p in phases.items():
        extra = ""
        if name in ("refuse_10mb", "ids_20mb"):
            num = sum(r["requests"] for r in p["rounds"])
            extra = (f"; {num} refused ({','.join(p['codes'])}): "
                     f"p50 {p['refusal_p50_s'] * 1e3:.0f} ms, max {p['refusal_max_s'] * 1e3:.0f} ms")
        elif name == "prompt_1mb":
            r = p["rounds"][-1]
            extra = (f"; {r['prompt_bytes']} B prompt {r['generate_code']} in {r['generate_s']:.2f} s, "
                     f"Tokenize {r['tokenize_ids']} ids in {r['tokenize_s']:.2f} s (last round)")
        print(f"{name}: longest token gap median {p['max_token_gap_s_median'] * 1e3:.0f} ms, worst "
              f"{p['max_token_gap_s_worst'] * 1e3:.0f} ms over {args.rounds} rounds ({args.streams} streams){extra}",
              flush=True)
    out = {"command": f"python bench/gateway_dos.py --streams {args.streams} --repeats {args.repeats} "
                      f"--rounds {args.rounds}",
           "engine": ENGINE, "limits": dataclasses.asdict(LimitsConfig()), "phases": phases, "pass": ok,
           "target": f"10 MB prompt refused within {REFUSAL_TARGET_S * 1e3:.0f} ms (p50); no token gap above "
                     f"{GAP_TARGET_S * 1e3:.0f} ms (median over rounds of each round's longest) in any phase"}
    return write_result(args.out, out, ok)


if __name__ == "__main__":
    raise SystemExit(main())
