"""One benchmark run: send the requests at a rate through a backend, gather the results.

    results, duration_s = await run_at_rate(backend, requests, rate, seed)

Arrivals: rate requests/s as a Poisson process (exponential gaps, seeded), or all at once
for rate = inf. Each request is one backend.one_request (services/bench/base.py: one
stream, timed from the moment it is sent); a request that fails is recorded with its
error and the others go on. `concurrency` > 0 bounds the requests in flight (later
arrivals wait for a slot, as `vllm bench serve --max-concurrency` does).
"""
from __future__ import annotations

import asyncio
import math
import random
import time

from services.bench.base import Backend
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


async def run_at_rate(backend: Backend, requests: list[BenchRequest], rate: float, seed: int = 0,
                      concurrency: int = 0) -> tuple[list[RequestResult], float]:
    """Every request, arriving at `rate`; returns the results (in request order) and the
    run's duration (first send -> last completion)."""
    slots = asyncio.Semaphore(concurrency) if concurrency > 0 else None

    async def send(req: BenchRequest) -> RequestResult:
        if slots is None:
            return await backend.one_request(req)
        async with slots:
            return await backend.one_request(req)

    start = time.perf_counter()
    tasks = []
    for gap, req in zip(arrival_gaps(len(requests), rate, seed), requests):
        if gap:
            await asyncio.sleep(gap)
        tasks.append(asyncio.ensure_future(send(req)))
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start
