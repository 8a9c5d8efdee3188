"""A prefill node inside the test process, for engine-level tests of disaggregation: it
computes the prompt on its own LLMEngine and copies the KV into the decode engine's
destination blocks (what a KV push does), then answers the first token. It speaks the
RemoteKV protocol of common/engine/remote_kv.py (fill / cancel / settled)."""
from __future__ import annotations

import asyncio
import dataclasses
import threading
from typing import Callable

from common.engine.llm_engine import LLMEngine
from common.engine.sampling_params import SamplingParams


class InProcessPrefill:
    """One request's prefill. after_fill(loop) runs on the event loop just before fill
    returns (to inject stalls); fills of one prefill engine run one at a time."""

    _locks: dict[int, threading.Lock] = {}

    def __init__(self, prefill: LLMEngine, decode: LLMEngine, request_id: str, prompt: list[int],
                 params: SamplingParams, after_fill: Callable[[asyncio.AbstractEventLoop], None] | None = None):
        self.prefill, self.decode = prefill, decode
        self.request_id, self.prompt, self.params = request_id, list(prompt), params
        self.after_fill = after_fill
        self.num_fills = 0
        self._lock = self._locks.setdefault(id(prefill), threading.Lock())

    def _compute(self, block_ids: list[int], num_cached_tokens: int) -> int:
        with self._lock:
            engine = self.prefill
            rid = f"prefill-{self.request_id}-{self.num_fills}"
            seq = engine.add_request(rid, self.prompt, dataclasses.replace(self.params, max_tokens=1, stop=[]),
                                     hold_blocks=True)
            first = None
            while first is None:
                for out in engine.step():
                    if out.request_id == rid:
                        first = out.new_token_ids[0]
            bs = engine.block_size
            for i in range(num_cached_tokens // bs, len(block_ids)):
                self.decode.kv_cache[:, :, block_ids[i]].copy_(engine.kv_cache[:, :, seq.block_ids[i]])
            engine.release(rid)
            return first

    async def fill(self, block_ids: list[int], num_cached_tokens: int):
        from common.engine.remote_kv import KVFilled
        first = await self.run(block_ids, num_cached_tokens)
        return KVFilled(len(self.prompt), first)

    async def run(self, block_ids: list[int], num_cached_tokens: int) -> int:
        self.num_fills += 1
        first = await asyncio.to_thread(self._compute, list(block_ids), num_cached_tokens)
        if self.after_fill is not None:
            self.after_fill(asyncio.get_running_loop())
        return first

    async def cancel(self) -> bool:
        return True

    async def settled(self) -> None:
        return None
