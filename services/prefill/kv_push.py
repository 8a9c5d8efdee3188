"""Pushes a prefill's KV into the decode node's blocks, layer by layer (default) or chunk
by chunk, while the prompt is still being computed.

    layerwise: forward pass of a step, layer l wrote the chunk's KV --on_layer (step
               thread)--> one batched write of layer l of the chunk's complete blocks,
               submitted to the executor at once: it runs while layers l+1.. compute
    chunk:     the step computed tokens [start, end) --on_computed (step thread, after
               the step)--> one batched write of every layer of those blocks, submitted
               to the executor at once

The step thread never waits for a write, nor for the event loop: it only submits. The
event loop sees the writes (`writes`, asyncio futures) when it looks (finish, stop,
settled, settle). `stopped` is set under the lock that submission holds, so once it is
set nothing more is submitted.

Block i of the prompt is sent once it is full and computed, or at the end of the prompt
for the last, partial block, of which only the prompt's token slots are written (the
decode node writes the rest itself). Blocks the destination already holds (its
prefix-cache hit, `num_cached_tokens`) are never sent. Layerwise, a chunk's blocks are
fixed at its layer 0 and each layer of them is one write; when the engine calls no layer
hook for a chunk (an engine without one), on_computed writes its blocks per chunk. No
write starts past the request's deadline or after `stop` (checked on the executor thread,
right before the write), and each ends within min(timeouts.transfer_s, what remains of
it).

`finish` waits for every write (every layer of every block) and raises the first
TransferError, so the prefill answers only once all of them landed; `stop` (cancel,
failure) submits nothing more and waits up to twice the transfer timeout (the longest a
transfer call runs) for the writes in flight: True when all of them ended (settled).
`settle` waits for them however long they take (before the source blocks may be freed).

Mode: `layerwise` (True, transfer.kv_push "layerwise", the default) or per chunk (False,
"chunk"); always per chunk into a destination that stages its batches (a tensor-parallel
push gathered into whole blocks, kv_destination.StagedWrites: the gather is a collective
of the node's ranks, which runs between steps, not inside the forward pass).
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future

from common.transfer.base import TransferError



class LayerHooks:
    """An engine's on_computed with a layer hook (common/engine/step_runner.py):
    `hooks(seq, start, end)` after the step, `hooks.on_layer(seq, layer, start, end)`
    inside it."""

    __slots__ = ("after_step", "on_layer")

    def __init__(self, after_step: Callable[..., None], on_layer: Callable[..., None]):
        self.after_step, self.on_layer = after_step, on_layer

    def __call__(self, seq, start: int, end: int) -> None:
        self.after_step(seq, start, end)


class KVPusher:
    def __init__(self, destination, executor: Executor,
                 dst_block_ids: list[int], dst_num_cached_tokens: int, block_size: int,
                 num_prompt_tokens: int, deadline: float, transfer_timeout_s: float,
                 layerwise: bool = True):
        """destination: what makes each batched write (kv_destination.py: one rank, or
        every rank of a tensor-parallel node)."""
        self.destination, self.executor = destination, executor
        self._staged = getattr(destination, "staged", False)
        if self._staged:
            layerwise = False   # a staged batch is gathered between steps, all layers at once
        self.dst_block_ids = dst_block_ids
        self.block_size = block_size
        self.num_prompt_tokens = num_prompt_tokens
        self.deadline, self.transfer_timeout_s = deadline, transfer_timeout_s
        self.layerwise = layerwise
        # what the engine calls (add_request's on_computed)
        self.on_computed = (LayerHooks(self._chunk_computed, self._layer_computed) if self.layerwise
                            else self._chunk_computed)
        self.next_block = dst_num_cached_tokens // block_size
        self.loop = asyncio.get_running_loop()
        self.bytes_written = 0
        self.num_writes = 0          # submitted to the executor
        self.error: TransferError | None = None
        self._stopped = False
        self._writes: list[asyncio.Future] = []
        self._submitted: list[Future] = []     # not yet seen by the event loop
        self._chunk: tuple[list[int], list[int], int | None] | None = None   # layerwise: this step's
        self._lock = threading.Lock()

    # ---- step thread ----------------------------------------------------------------
    def _take_blocks(self, seq, end: int) -> tuple[list[int], list[int], int | None] | None:
        """(source ids, destination ids, token slots of a partial last block or None) of
        the blocks [next_block, last complete block at `end`), which count as sent from
        now on; None when there are none."""
        num_full = end // self.block_size
        partial = end == self.num_prompt_tokens and end % self.block_size
        last = num_full + 1 if partial else num_full
        if last <= self.next_block:
            return None
        blocks = range(self.next_block, last)
        self.next_block = last
        return ([seq.block_ids[i] for i in blocks], [self.dst_block_ids[i] for i in blocks],
                end % self.block_size if partial else None)

    def _chunk_computed(self, seq, start: int, end: int) -> None:
        """After the step that computed [start, end): its blocks not sent yet (layerwise:
        none, unless no layer hook ran), every layer in one write."""
        self._chunk = None
        blocks = self._take_blocks(seq, end)
        if blocks is not None:
            self._submit(*blocks, None)

    def _layer_computed(self, seq, layer: int, start: int, end: int) -> None:
        """Inside the step's forward pass, once `layer` wrote the KV of [start, end)."""
        if layer == 0:
            self._chunk = self._take_blocks(seq, end)
        if self._chunk is not None:
            self._submit(*self._chunk, (layer,))

    def _submit(self, src: list[int], dst: list[int], last_tokens: int | None,
                layers: tuple[int, ...] | None) -> None:
        """Hand one write to the executor, unless stopped or past the deadline. A staged
        batch is gathered (a collective of the node's ranks, milliseconds) outside the
        lock, which the event loop takes too."""
        if not self._may_start():
            return
        if self._staged:    # gathered between steps into whole blocks (kv_destination.StagedWrites)
            try:
                src = self.destination.stage(src)
            except Exception as e:   # the node's ranks failed: nothing was written
                self.error = self.error or TransferError(f"the KV push could not gather its blocks: {e}")
                return
        with self._lock:
            if self._stopped:
                self._discard(src)
                return
            try:
                future = self.executor.submit(self._send, src, dst, last_tokens, layers)
            except RuntimeError as e:   # the executor is shut down: the node is stopping
                self._discard(src)
                self.error = self.error or TransferError(f"the KV push could not start a write: {e}")
                return
            self._submitted.append(future)
            self.num_writes += 1

    def _may_start(self) -> bool:
        with self._lock:
            if self._stopped:
                return False
            if self.deadline - time.monotonic() <= 0:
                self.error = self.error or TransferError("the request's deadline passed before its KV was sent")
                return False
            return True

    def _discard(self, src) -> None:
        if self._staged:
            self.destination.discard(src)

    # ---- executor thread ------------------------------------------------------------
    def _send(self, src: list[int], dst: list[int], last_tokens: int | None,
              layers: tuple[int, ...] | None) -> int:
        """The write, unless the pusher was stopped or the deadline passed while it waited
        for a thread (then it writes nothing: a settled TransferError)."""
        remaining = self.deadline - time.monotonic()
        if self._stopped or remaining <= 0:
            self._discard(src)
            raise TransferError("the KV push was stopped, or its deadline passed, before this write started")
        return self.destination.write(src, dst, layers, last_tokens, min(self.transfer_timeout_s, remaining))

    # ---- event loop -----------------------------------------------------------------
    @property
    def stopped(self) -> bool:
        return self._stopped

    @stopped.setter
    def stopped(self, value: bool) -> None:
        """Set under the submission lock: once True, no write is submitted any more."""
        with self._lock:
            self._stopped = value

    @property
    def writes(self) -> list[asyncio.Future]:
        """Event loop: every write submitted so far, as asyncio futures of this loop."""
        with self._lock:
            submitted, self._submitted = self._submitted, []
        self._writes.extend(asyncio.wrap_future(f, loop=self.loop) for f in submitted)
        return self._writes

    async def finish(self) -> int:
        """Wait until every write is acknowledged; returns bytes written."""
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
            if e is not None and not isinstance(e, ValueError) and (not isinstance(e, TransferError) or e.unsettled):
                return False    # bytes may still land (a ValueError is a plan error: nothing sent)
        return True

    async def settle(self) -> None:
        """Wait for every write to end, however long (the source blocks stay held)."""
        self.stopped = True
        writes = self.writes
        if writes:
            await asyncio.wait(writes)
