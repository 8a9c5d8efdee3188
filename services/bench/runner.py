"""One benchmark run: send the requests at a rate to a pdmesh gateway, time each stream.

    results, duration_s = await run_at_rate(channel, requests, rate, seed)

Arrivals: rate requests/s as a Poisson process (exponential gaps, seeded), or all at once
for rate = inf. Each request is one Generate stream (greedy, ignore_eos, max_tokens from
the request), timed from the moment it is sent: the first message with tokens is the
TTFT, each later one adds an ITL gap, the last one ends E2E. A stream that fails is
recorded with its status code; the others go on. `concurrency` > 0 bounds the requests in
flight (later arrivals wait for a slot, as `vllm bench serve --max-concurrency` does).
"""
from __future__ import annotations

import asyncio
import math
import random
import time

import grpc

from protos.pdmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.bench.datasets import BenchRequest
from services.bench.metrics import RequestResult


def arrival_gaps(num: int, rate: float, seed: int) -> list[float]:
    """Seconds to wait before each request (the first is sent at once)."""
    if math.isinf(rate):
        return [0.0] * num
    if rate <= 0:
        raise ValueError(f"a request rate must be > 0 (or inf), got {rate}")
    rng = random.Random(seed)
    return [0.0, *(rng.expovariate(rate) for _ in range(num - 1))][:num]


def _message(req: BenchRequest, model: str) -> gateway_pb2.GenerateRequest:
    msg = gateway_pb2.GenerateRequest(model=model, sampling=common_pb2.SamplingParams(
        max_tokens=req.max_tokens, temperature=0.0, ignore_eos=True))
    if req.prompt_token_ids:
        msg.prompt_token_ids.ids.extend(req.prompt_token_ids)
    else:
        msg.prompt = req.prompt
    return msg


async def one_request(stub, req: BenchRequest, model: str = "", timeout_s: float = 600.0) -> RequestResult:
    result = RequestResult(num_prompt_tokens=req.num_prompt_tokens)
    start = time.perf_counter()
    last = None
    try:
        async for msg in stub.Generate(_message(req, model), timeout=timeout_s):
            now = time.perf_counter()
            if msg.token_ids:
                if last is None:
                    result.ttft_s = now - start
                else:
                    result.itl_s.append(now - last)
                last = now
                result.num_output_tokens += len(msg.token_ids)
            if msg.finish_reason:
                result.num_prompt_tokens = msg.usage.prompt_tokens or result.num_prompt_tokens
        result.e2e_s = time.perf_counter() - start
    except grpc.aio.AioRpcError as e:
        result.error = e.code().name
    return result


async def run_at_rate(channel, requests: list[BenchRequest], rate: float, seed: int = 0, model: str = "",
                      concurrency: int = 0) -> tuple[list[RequestResult], float]:
    """Every request, arriving at `rate`; returns the results (in request order) and the
    run's duration (first send -> last completion)."""
    stub = gateway_pb2_grpc.GatewayStub(channel)
    slots = asyncio.Semaphore(concurrency) if concurrency > 0 else None

    async def send(req: BenchRequest) -> RequestResult:
        if slots is None:
            return await one_request(stub, req, model)
        async with slots:
            return await one_request(stub, req, model)

    start = time.perf_counter()
    tasks = []
    for gap, req in zip(arrival_gaps(len(requests), rate, seed), requests):
        if gap:
            await asyncio.sleep(gap)
        tasks.append(asyncio.ensure_future(send(req)))
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start
