"""The `pdmesh up --demo` client: a few built-in prompts sent through a gateway at once.

Each request's text is printed when its stream ends (in completion order), with its TTFT
and tokens/s; then one line for the whole batch. Greedy, ignore_eos, so every request
makes exactly max_tokens tokens. With the gateway's HTTP API on, one chat request over
HTTP follows (its answer may end early, at the model's eos).
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


def http_chat(http_address: str, api_key: str | None, max_tokens: int, content: str = "Hello! Who are you?") -> int:
    """One POST /v1/chat/completions to the gateway's OpenAI-compatible API (the stdlib's
    urllib, as any HTTP client would); prints the answer; 0 when it came, else 1."""
    import json
    import urllib.error
    import urllib.request
    body = {"model": "", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0}
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    req = urllib.request.Request(f"{http_address}/v1/chat/completions", json.dumps(body).encode(), headers)
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            answer = json.load(r)
    except (urllib.error.URLError, OSError, ValueError) as e:
        print(f"--- HTTP chat request failed: {e}", flush=True)
        return 1
    usage = answer["usage"]
    print(f"--- HTTP POST {http_address}/v1/chat/completions {content!r}: {usage['completion_tokens']} tokens "
          f"in {time.perf_counter() - start:.2f} s\n{answer['choices'][0]['message']['content']}", flush=True)
    return 0


def run_demo(address: str, prompts: list[str] | None = None, max_tokens: int = 48,
             api_key: str | None = None, tls=None, http_address: str = "") -> int:
    """The gRPC demo, then (http_address: the gateway's HTTP API, "" = none) one chat
    request over HTTP."""
    code = asyncio.run(demo(address, list(prompts or DEMO_PROMPTS), max_tokens, api_key, tls))
    if http_address and tls is None:
        code |= http_chat(http_address, api_key, max_tokens)
    return code
