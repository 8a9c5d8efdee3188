"""The `pdmesh up --demo` client: a few built-in prompts sent through a gateway at once.

Each request's text is printed when its stream ends (in completion order), with its TTFT
and tokens/s; then one line for the whole batch. Greedy, ignore_eos, so every request
makes exactly max_tokens tokens.
"""
from __future__ import annotations

import asyncio
import statistics
import time

import grpc

from services.cli.generate import DEMO_PROMPTS
from services.cli.client import StreamResult, describe, stream_generate


async def _one(channel, index: int, prompt: str, max_tokens: int) -> StreamResult | None:
    try:
        result = await stream_generate(channel, prompt, max_tokens=max_tokens, ignore_eos=True,
                                       request_id=f"demo-{index}")
    except grpc.aio.AioRpcError as e:
        print(f"--- [{index}] {prompt!r} failed: {e.code().name}: {e.details()}", flush=True)
        return None
    print(f"--- [{index}] {prompt!r}: {describe(result)}\n{prompt}{result.text}", flush=True)
    return result


async def demo(address: str, prompts: list[str], max_tokens: int, api_key: str | None = None,
               tls=None) -> int:
    """Stream every prompt concurrently; returns 0 when all succeeded, else 1."""
    from services.security.client_auth import client_channel
    async with client_channel(address, bearer=api_key, tls=tls) as channel:
        start = time.perf_counter()
        results = await asyncio.gather(*(_one(channel, i, p, max_tokens) for i, p in enumerate(prompts)))
        elapsed = time.perf_counter() - start
    done = [r for r in results if r is not None]
    num_tokens = sum(len(r.token_ids) for r in done)
    ttfts_ms = [r.ttft_s * 1000 for r in done] or [0.0]
    print(f"--- {len(done)}/{len(prompts)} requests, {num_tokens} tokens in {elapsed:.2f} s: "
          f"{num_tokens / elapsed:.1f} tokens/s overall; TTFT p50 {statistics.median(ttfts_ms):.1f} ms, "
          f"max {max(ttfts_ms):.1f} ms", flush=True)
    return 0 if len(done) == len(prompts) else 1


def run_demo(address: str, prompts: list[str] | None = None, max_tokens: int = 48,
             api_key: str | None = None, tls=None) -> int:
    return asyncio.run(demo(address, list(prompts or DEMO_PROMPTS), max_tokens, api_key, tls))
