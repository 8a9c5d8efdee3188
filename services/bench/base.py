"""What `pdmesh bench serve` measures through: a Backend sends one request and times its
stream; the runner (services/bench/runner.py) decides when.

    async with create_backend("openai", base_url="http://127.0.0.1:8000") as backend:
        info = await backend.model_info()          # ModelInfo: id, vocab_size, max_model_len
        result = await backend.one_request(req)     # a RequestResult, never raises for the server

Every backend times a request the same way (metrics.py's definitions): from the moment it
is sent, the first streamed message carrying tokens is the TTFT, each later one adds an
ITL gap, the end of the stream ends E2E. A request the server fails or refuses is a
RequestResult with `error` set (a gRPC status name, "HTTP_<code>", ...), so the others go on.

Backends by name, imported only when asked for (grpc needs the generated protos, openai
needs aiohttp).
"""
from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass

from services.bench.datasets import BenchRequest
from services.bench.metrics import RequestResult


class ServerUnreachable(Exception):
    """model_info could not ask the server (refused, down, not that kind of server); the
    message names the server and why."""


@dataclass(frozen=True)
class ModelInfo:
    id: str
    vocab_size: int = 0          # 0: the server does not say
    max_model_len: int = 0       # 0: the server does not say


class Backend(ABC):
    """One server under test. Not thread-safe; one event loop. one_request may run many
    times at once (one task each)."""

    name: str = ""

    @abstractmethod
    async def model_info(self) -> ModelInfo:
        """The served model; raises when the server cannot be reached (the run cannot start):
        ServerUnreachable, or grpc.aio.AioRpcError from the grpc backend."""

    @abstractmethod
    async def one_request(self, req: BenchRequest) -> RequestResult:
        """Send req (greedy, max_tokens, ignore_eos as req says) and time its stream."""

    async def close(self) -> None:
        """Release connections; a no-op by default."""

    async def __aenter__(self) -> "Backend":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


BACKENDS = {
    "grpc": ("services.bench.grpc_backend", "GrpcBackend"),
    "openai": ("services.bench.openai_backend", "OpenAIBackend"),
}


def create_backend(name: str, **options) -> Backend:
    """A new backend of that name, constructed with `options` (its ctor keywords);
    ValueError naming the allowed names."""
    if name not in BACKENDS:
        raise ValueError(f"unknown bench backend {name!r}; allowed: {', '.join(BACKENDS)}")
    module, cls = BACKENDS[name]
    return getattr(importlib.import_module(module), cls)(**options)
