"""The `pdmesh up --demo` client: a few built-in prompts sent through a gateway at once.

An instruct model with a chat template (e.g. SmolLM2 from `pdmesh models pull`) gets
DEMO_QUESTIONS, questions whose answers a person can check, each rendered with the
model's chat template and answered greedily up to its end of turn (or max_tokens). The
tiny random model (chat=False), or a model without a template, gets plain text prompts,
ignore_eos, exactly max_tokens tokens.
Each request's text is printed when its stream ends (in completion order), with its TTFT
and tokens/s; then one line for the whole batch. With the gateway's HTTP API on, one chat
request over HTTP follows (its answer may end early, at the model's eos).
"""
from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass

import grpc

from services.cli.generate import DEMO_PROMPTS
from services.cli.client import StreamResult, describe, stream_generate

DEMO_QUESTIONS = [   # SmolLM2-135M-Instruct answers each correctly, greedy
    "What is the capital of France? Answer in one sentence.",
    "What is the chemical symbol for gold?",
    "Name the three primary colors.",
    "What is 2 + 2?",
]


@dataclass(frozen=True)
class DemoPrompt:
    shown: str             # what the user asked (the question, or the plain prompt)
    prompt: str            # what is sent: the question in the chat template, or the prompt
    chat: bool


def demo_prompts(model: str | None, prompts: list[str] | None = None, chat: bool = True) -> list[DemoPrompt]:
    """The demo's requests for `model` (a folder or .gguf; None: plain prompts): chat
    questions when chat and the model has a chat template."""
    template = None
    if model is not None and chat:
        from services.gateway.openai_http.chat_template import ChatTemplate
        template = ChatTemplate.from_dir(model)
    if template is None:
        return [DemoPrompt(p, p, False) for p in prompts or DEMO_PROMPTS]
    return [DemoPrompt(q, template.render([{"role": "user", "content": q}]), True)
            for q in prompts or DEMO_QUESTIONS]


async def _one(channel, index: int, item: DemoPrompt, max_tokens: int) -> StreamResult | None:
    sampling = {"max_tokens": max_tokens} if item.chat else {"max_tokens": max_tokens, "ignore_eos": True}
    try:
        result = await stream_generate(channel, item.prompt, temperature=0.0, request_id=f"demo-{index}",
                                       **sampling)
    except grpc.aio.AioRpcError as e:
        print(f"--- [{index}] {item.shown!r} failed: {e.code().name}: {e.details()}", flush=True)
        return None
    shown = result.text.strip() if item.chat else item.prompt + result.text
    print(f"--- [{index}] {item.shown!r}: {describe(result)}\n{shown}", flush=True)
    return result


async def demo(address: str, prompts: list[DemoPrompt], max_tokens: int, api_key: str | None = None,
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


def http_chat(http_address: str, api_key: str | None, max_tokens: int,
              content: str = "Hello! Who are you? Answer in one sentence.") -> int:
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


def run_demo(address: str, prompts: list[str] | None = None, max_tokens: int = 64,
             api_key: str | None = None, tls=None, http_address: str = "", model: str | None = None,
             chat: bool = True) -> int:
    """The gRPC demo (chat: questions in the chat template of `model` when it has one),
    then (http_address: the gateway's HTTP API, "" = none) one chat request over HTTP."""
    code = asyncio.run(demo(address, demo_prompts(model, prompts, chat), max_tokens, api_key, tls))
    if http_address and tls is None:
        code |= http_chat(http_address, api_key, max_tokens)
    return code
