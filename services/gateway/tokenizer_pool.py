"""Tokenization off the gateway's event loop.

A text prompt of limits.max_prompt_bytes (1 MiB) takes about a second to tokenize; on
the event loop that second would stall every other stream of the gateway. The pool runs
it in one of `threads` worker threads, through tokenizers' `encode_batch_fast`, which
releases the GIL while it works (`encode` holds it: from another thread it would stall
the loop as much). The ids are those of Tokenizer.encode (no offsets are computed).

The workers run at a lower CPU priority (nice +WORKER_NICENESS, Linux: per thread), so
that on a host short of cores a long text yields the CPU to the event loop and to the
engines beside it instead of slowing every stream. Calls beyond `threads` wait for a
free worker in the pool's queue, at most QUEUED_PER_THREAD x threads of them: beyond,
encode() raises TokenizerBusy at once (RESOURCE_EXHAUSTED: one client sending many long
texts cannot make everyone else's wait grow without bound). Event loop only; close()
once, when the gateway stops.
"""
from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import ThreadPoolExecutor

from common.model.tokenizer import Tokenizer

WORKER_NICENESS = 10
QUEUED_PER_THREAD = 4


class TokenizerBusy(Exception):
    """Every worker is busy and the queue is full."""


class TokenizerPool:
    def __init__(self, tokenizer: Tokenizer, threads: int):
        self.tokenizer = tokenizer
        self.max_in_flight = threads * (1 + QUEUED_PER_THREAD)
        self.in_flight = 0
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="gateway-tokenizer",
                                        initializer=_lower_priority)

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Tokenizer.encode(text, add_special_tokens), in a worker thread. TokenizerBusy
        when max_in_flight texts are being tokenized or wait for it already."""
        if self.in_flight >= self.max_in_flight:
            raise TokenizerBusy(f"the gateway is tokenizing {self.in_flight} texts already; retry later")
        self.in_flight += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, self._encode, text,
                                                                    add_special_tokens)
        finally:
            self.in_flight -= 1

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        backend = getattr(self.tokenizer, "backend", None)
        if backend is None or not hasattr(backend, "encode_batch_fast"):
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    def close(self) -> None:
        """Drop queued work; a text being tokenized finishes in its thread, unawaited."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def _lower_priority() -> None:
    """In a worker: nice this thread alone (Linux setpriority takes a thread id); a no-op
    where that is not possible."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + WORKER_NICENESS)
    except (AttributeError, OSError):
        pass
