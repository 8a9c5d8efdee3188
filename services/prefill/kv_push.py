"""Pushes a prefill's KV into the decode node's blocks chunk by chunk.

    engine step computes tokens [start, end) --on_computed (step thread)--> blocks now
    complete are handed to the event loop --> one batched write each, on the executor.

Block i of the prompt is sent once it is full and computed, or at the end of the prompt
for the last, partial block. Blocks the destination already holds (its prefix-cache hit,
`num_cached_tokens`) are never sent. `finish` waits for every write and raises the first
TransferError; `stop` (on cancel) stops new writes and waits for those in flight.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import Executor

from common.transfer.kv_writes import KVSender
from common.transfer.layout import KVLayout


class KVPusher:
    def __init__(self, sender: KVSender, executor: Executor, peer: str, dst_layout: KVLayout,
                 dst_block_ids: list[int], dst_num_cached_tokens: int, block_size: int,
                 num_prompt_tokens: int):
        self.sender, self.executor, self.peer = sender, executor, peer
        self.dst_layout, self.dst_block_ids = dst_layout, dst_block_ids
        self.block_size = block_size
        self.num_prompt_tokens = num_prompt_tokens
        self.next_block = dst_num_cached_tokens // block_size
        self.loop = asyncio.get_running_loop()
        self.writes: list[asyncio.Future] = []
        self.bytes_written = 0
        self.stopped = False

    def on_computed(self, seq, start: int, end: int) -> None:
        """Step thread: queue writes for the blocks [next_block, last complete block]."""
        num_full = end // self.block_size
        last = num_full + 1 if end == self.num_prompt_tokens and end % self.block_size else num_full
        if last <= self.next_block:
            return
        blocks = range(self.next_block, last)
        src = [seq.block_ids[i] for i in blocks]
        dst = [self.dst_block_ids[i] for i in blocks]
        self.next_block = last
        self.loop.call_soon_threadsafe(self._submit, src, dst)

    def _submit(self, src: list[int], dst: list[int]) -> None:
        if self.stopped:
            return
        self.writes.append(self.loop.run_in_executor(
            self.executor, self.sender.send_blocks, self.peer, self.dst_layout, src, dst))

    async def finish(self) -> int:
        """Wait until every queued write is acknowledged; returns bytes written."""
        await asyncio.sleep(0)  # let the last call_soon_threadsafe land
        results = await asyncio.gather(*self.writes)
        self.bytes_written = sum(results)
        return self.bytes_written

    async def stop(self) -> None:
        self.stopped = True
        await asyncio.sleep(0)
        if self.writes:
            await asyncio.wait(self.writes)
