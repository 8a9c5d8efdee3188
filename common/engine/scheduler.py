"""Continuous batching with chunked prefill and preemption by recompute.

Each step has a budget of `max_num_batched_tokens`. Running sequences go first, oldest
first: a decoding one takes 1 token, a prefilling one the next chunk of its prompt. When a
running sequence needs a block and none is free, the newest running sequence is preempted
(blocks freed, back to the front of the waiting queue, recomputed later). Waiting
sequences are admitted in FIFO order while seats (`max_num_seqs`), budget and blocks last;
admission allocates blocks for the whole prompt, prefix-cache hits first. A sequence
marked `remote_prefill` is admitted into `remote` instead (its KV comes from a prefill
node; `on_remote_admit` is told) and joins `running` later through `add_running`.

Not thread-safe: the engine's step loop owns it.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from common.engine.block_manager import BlockManager
from common.engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    """Sequences to run this step: decodes (one token each) then prefill chunks."""

    decode_seqs: list[Sequence] = field(default_factory=list)
    prefill_seqs: list[Sequence] = field(default_factory=list)
    prefill_lens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.decode_seqs and not self.prefill_seqs

    @property
    def num_tokens(self) -> int:
        return len(self.decode_seqs) + sum(self.prefill_lens)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int,
                 max_num_batched_tokens: int, enable_chunked_prefill: bool = True):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.remote: dict[str, Sequence] = {}
        self.on_remote_admit: Callable[[Sequence], None] | None = None
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        """Work a step can do (sequences in remote prefill wait on another node)."""
        return bool(self.waiting or self.running)

    @property
    def num_seats_taken(self) -> int:
        return len(self.running) + len(self.remote)

    def add_running(self, seq: Sequence) -> None:
        """A remote-prefilled sequence joins the batch (its blocks hold the prompt's KV)."""
        self.remote.pop(seq.request_id, None)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bm = self.block_manager
        scheduled: list[Sequence] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            while not bm.can_append(seq):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                break
            bm.append_slots(seq)
            budget -= self._take(out, seq, budget)
            scheduled.append(seq)
            i += 1
        if out.preempted:
            return out
        while self.waiting and self.num_seats_taken < self.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            if not bm.allocate(seq):
                break
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.perf_counter()
            if seq.remote_prefill:
                self.waiting.popleft()
                seq.num_cached_tokens = seq.num_computed_tokens
                seq.status = SequenceStatus.REMOTE_PREFILL
                self.remote[seq.request_id] = seq
                if self.on_remote_admit is not None:
                    self.on_remote_admit(seq)
                continue
            if not self.enable_chunked_prefill and len(seq) - seq.num_computed_tokens > budget:
                bm.free(seq)
                break
            self.waiting.popleft()
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = seq.num_computed_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            budget -= self._take(out, seq, budget)
        return out

    @staticmethod
    def _take(out: SchedulerOutput, seq: Sequence, budget: int) -> int:
        remaining = len(seq) - seq.num_computed_tokens
        if remaining == 1:
            out.decode_seqs.append(seq)
            return 1
        n = min(remaining, budget)
        out.prefill_seqs.append(seq)
        out.prefill_lens.append(n)
        return n

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, status: SequenceStatus, free_blocks: bool = True) -> None:
        """Mark seq finished; it leaves running, waiting or remote. Its blocks are freed
        unless free_blocks is False (the caller then owns them)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        else:
            self.remote.pop(seq.request_id, None)
        if seq.block_ids and free_blocks:
            self.block_manager.free(seq)
        seq.status = status

    def find(self, request_id: str) -> Sequence | None:
        for seq in self.running:
            if seq.request_id == request_id:
                return seq
        for seq in self.waiting:
            if seq.request_id == request_id:
                return seq
        return self.remote.get(request_id)
