"""A small client of the public API (pdmesh.v1.Gateway): stream one request, time it.

    async with client_channel("127.0.0.1:50050", bearer=api_key()) as channel:   # services/security
        result = await stream_generate(channel, "Hello", max_tokens=32,
                                       on_text=lambda s: print(s, end="", flush=True))
    print(result.ttft_s, result.tokens_per_s, result.finish_reason)

Errors are the gateway's: `grpc.aio.AioRpcError` (INVALID_ARGUMENT, UNAVAILABLE, ...)
propagates to the caller. A channel may carry many concurrent calls.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import grpc

from protos.pdmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0


@dataclass(frozen=True)
class StreamResult:
    """One finished request. ttft_s: from sending to the first message with tokens;
    elapsed_s: from sending to the end of the stream."""

    token_ids: list[int]
    text: str
    ttft_s: float
    elapsed_s: float
    finish_reason: str
    usage: Usage = field(default_factory=Usage)

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens over the whole request time (TTFT included)."""
        return len(self.token_ids) / self.elapsed_s if self.elapsed_s > 0 else 0.0


def build_request(prompt: str | Sequence[int], *, max_tokens: int = 64, temperature: float = 0.0,
                  top_p: float = 1.0, top_k: int = -1, seed: int | None = None,
                  stop: Sequence[str] = (), ignore_eos: bool = False, model: str = "",
                  request_id: str = "") -> gateway_pb2.GenerateRequest:
    """A GenerateRequest for a text prompt or a list of token ids."""
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                         top_p=top_p, top_k=top_k, stop=list(stop),
                                         ignore_eos=ignore_eos)
    if seed is not None:
        sampling.seed = seed
    req = gateway_pb2.GenerateRequest(request_id=request_id, sampling=sampling, model=model)
    if isinstance(prompt, str):
        req.prompt = prompt
    else:
        req.prompt_token_ids.ids.extend(prompt)
    return req


async def stream_generate(channel: grpc.aio.Channel, prompt: str | Sequence[int], *,
                          on_text: Callable[[str], None] | None = None,
                          timeout_s: float | None = None, **sampling) -> StreamResult:
    """Send one Generate request and consume its stream; on_text(chunk) is called with each
    non-empty text chunk as it arrives. sampling: build_request's keyword arguments."""
    stub = gateway_pb2_grpc.GatewayStub(channel)
    token_ids: list[int] = []
    chunks: list[str] = []
    finish_reason, usage, ttft = "", Usage(), 0.0
    start = time.perf_counter()
    async for msg in stub.Generate(build_request(prompt, **sampling), timeout=timeout_s):
        if msg.token_ids and not token_ids:
            ttft = time.perf_counter() - start
        token_ids.extend(msg.token_ids)
        if msg.text:
            chunks.append(msg.text)
            if on_text is not None:
                on_text(msg.text)
        if msg.finish_reason:
            finish_reason = msg.finish_reason
            u = msg.usage
            usage = Usage(u.prompt_tokens, u.completion_tokens, u.cached_prompt_tokens)
    return StreamResult(token_ids, "".join(chunks), ttft, time.perf_counter() - start,
                        finish_reason, usage)


def describe(result: StreamResult) -> str:
    """One line of timings: TTFT, tokens, time, tokens/s, finish reason."""
    return (f"ttft {result.ttft_s * 1000:.1f} ms, {len(result.token_ids)} tokens in "
            f"{result.elapsed_s:.2f} s: {result.tokens_per_s:.1f} tokens/s "
            f"(finish_reason={result.finish_reason or 'none'})")
