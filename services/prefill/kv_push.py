"""Pushes a prefill's KV into the decode node's blocks chunk by chunk.

    engine step computes tokens [start, end) --on_computed (step thread)--> the blocks now
    complete are queued --> the event loop submits one batched write each, on the executor.

Block i of the prompt is sent once it is full and computed, or at the end of the prompt
for the last, partial block, of which only the prompt's token slots are written (the
decode node writes the rest itself). Blocks the destination already holds (its
prefix-cache hit, `num_cached_tokens`) are never sent. No write starts past the request's
deadline or after `stop` (checked on the executor thread, right before the write), and
each ends within min(timeouts.transfer_s, what remains of it).

`finish` submits what is queued, waits for every write and raises the first
TransferError; `stop` (cancel, failure) submits nothing more and waits up to twice the
transfer timeout (the longest a transfer call runs) for the writes in flight: True when
all of them ended (settled). `settle` waits for them
however long they take (before the source blocks may be freed).
"""
from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Executor

from common.transfer.base import TransferError
from common.transfer.kv_writes import KVSender
from common.transfer.layout import KVLayout


class KVPusher:
    def __init__(self, sender: KVSender, executor: Executor, peer: str, dst_layout: KVLayout,
                 dst_block_ids: list[int], dst_num_cached_tokens: int, block_size: int,
                 num_prompt_tokens: int, deadline: float, transfer_timeout_s: float):
        self.sender, self.executor, self.peer = sender, executor, peer
        self.dst_layout, self.dst_block_ids = dst_layout, dst_block_ids
        self.block_size = block_size
        self.num_prompt_tokens = num_prompt_tokens
        self.deadline, self.transfer_timeout_s = deadline, transfer_timeout_s
        self.next_block = dst_num_cached_tokens // block_size
        self.loop = asyncio.get_running_loop()
        self.writes: list[asyncio.Future] = []
        self.bytes_written = 0
        self.stopped = False
        self.error: TransferError | None = None
        self._queued: list[tuple[list[int], list[int], int | None]] = []
        self._lock = threading.Lock()

    def on_computed(self, seq, start: int, end: int) -> None:
        """Step thread: queue writes for the blocks [next_block, last complete block]."""
        num_full = end // self.block_size
        partial = end == self.num_prompt_tokens and end % self.block_size
        last = num_full + 1 if partial else num_full
        if last <= self.next_block:
            return
        blocks = range(self.next_block, last)
        src = [seq.block_ids[i] for i in blocks]
        dst = [self.dst_block_ids[i] for i in blocks]
        self.next_block = last
        with self._lock:
            self._queued.append((src, dst, end % self.block_size if partial else None))
        self.loop.call_soon_threadsafe(self._submit)

    def _submit(self) -> None:
        """Event loop: start a write for each queued range of blocks."""
        with self._lock:
            queued, self._queued = self._queued, []
        for src, dst, last_tokens in queued:
            if self.stopped:
                return
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                self.error = self.error or TransferError("the request's deadline passed before its KV was sent")
                return
            self.writes.append(self.loop.run_in_executor(
                self.executor, lambda s=src, d=dst, t=last_tokens: self._send(s, d, t)))

    def _send(self, src: list[int], dst: list[int], last_tokens: int | None) -> int:
        """Executor thread: the write, unless the pusher was stopped or the deadline passed
        while it waited for a thread (then it writes nothing: a settled TransferError)."""
        remaining = self.deadline - time.monotonic()
        if self.stopped or remaining <= 0:
            raise TransferError("the KV push was stopped, or its deadline passed, before this write started")
        return self.sender.send_blocks(self.peer, self.dst_layout, src, dst, last_block_tokens=last_tokens,
                                       timeout_s=min(self.transfer_timeout_s, remaining))

    async def finish(self) -> int:
        """Wait until every queued write is acknowledged; returns bytes written."""
        self._submit()
        # shielded: a cancelled caller must not mark writes still running in the executor done
        results = await asyncio.gather(*(asyncio.shield(w) for w in self.writes))
        if self.error is not None:
            raise self.error
        self.bytes_written = sum(results)
        return self.bytes_written

    async def stop(self) -> bool:
        """Start no more writes; wait up to 2 x transfer timeout for those in flight. True
        when every write has ended (none can land any more)."""
        self.stopped = True
        pending = [w for w in self.writes if not w.done()]
        if pending:
            await asyncio.wait(pending, timeout=2 * self.transfer_timeout_s)
        return self.settled

    @property
    def settled(self) -> bool:
        """Every write submitted has ended, none with ranges left in flight."""
        for w in self.writes:
            if not w.done() or w.cancelled():   # cancelled: its thread may still be writing
                return False
            e = w.exception()
            if isinstance(e, TransferError) and e.unsettled:
                return False
        return True

    async def settle(self) -> None:
        """Wait for every write to end, however long (the source blocks stay held)."""
        self.stopped = True
        if self.writes:
            await asyncio.wait(self.writes)
