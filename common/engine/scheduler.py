"""Continuous batching with chunked prefill and preemption by recompute; the owner of every
request's state (transitions: common/engine/lifecycle.py).

Each step has a budget of `max_num_batched_tokens`. Requests whose remote KV landed
(KV_READY) join the batch first. Running sequences go first, oldest first: a decoding one
takes 1 token, a prefilling one the next chunk of its prompt. When a running sequence
needs a block and none is free, the newest running sequence not yet scheduled this step
is preempted (blocks freed, back to the front of the waiting queue, recomputed here from
prompt + generated tokens). A sequence whose blocks are the source of a KV push
(`hold_blocks`) is never a victim. Waiting sequences are admitted in FIFO order while
seats (`max_num_seqs`), budget and blocks last; admission allocates blocks for the whole
prompt, prefix-cache hits first. A sequence with `kv_remote` set is admitted into
KV_REMOTE instead (`on_remote_admit` is told) and waits there, holding its seat, until
`kv_landed` or `kv_failed`; `admit_remote` admits those without waiting for a step, past
local sequences waiting for step budget when that costs them no seat and no block.

Blocks a remote writer may still write are QUARANTINED: kept referenced (so never handed
out) under the request id until `release_quarantine`.

Not thread-safe: one thread at a time drives it, whoever holds the engine (AsyncEngine:
its step thread, or a caller between steps or inside a step's forward window).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from common.engine.block_manager import BlockManager
from common.engine.lifecycle import RequestState, advance
from common.engine.sequence import Sequence

S = RequestState


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


@dataclass
class Quarantine:
    """Blocks kept because a remote writer may still write them; seq is the aborted request
    (QUARANTINED until released), or None when the request went on in fresh blocks."""

    block_ids: list[int]
    seq: Sequence | None


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int,
                 max_num_batched_tokens: int, enable_chunked_prefill: bool = True):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.remote: dict[str, Sequence] = {}          # KV_REMOTE
        self.ready: list[Sequence] = []                # KV_READY
        self.held: dict[str, Sequence] = {}            # HELD
        self.quarantined: dict[str, Quarantine] = {}   # by request id
        self.on_remote_admit: Callable[[Sequence], None] | None = None
        self.num_preemptions = 0
        self.num_quarantined_blocks = 0   # kept as a count: read from other threads

    # ---- reading ------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        """Work a step can do (KV_REMOTE sequences wait on another node)."""
        return bool(self.waiting or self.running or self.ready)

    def has_remote_kv(self) -> bool:
        """Some request's KV is being filled from elsewhere (KV_REMOTE), will be (waiting
        with kv_remote), or may still be written by a writer not known to have stopped
        (quarantined)."""
        return bool(self.remote or self.quarantined) or any(seq.kv_remote for seq in self.waiting)

    @property
    def num_seats_taken(self) -> int:
        return len(self.running) + len(self.remote) + len(self.ready)

    def find(self, request_id: str) -> Sequence | None:
        """The live (not done) sequence of request_id; None if there is none."""
        for seq in (*self.running, *self.waiting, *self.ready):
            if seq.request_id == request_id:
                return seq
        return self.remote.get(request_id) or self.held.get(request_id)

    # ---- transitions ----------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        assert seq.state == S.WAITING
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        for seq in self.ready:
            advance(seq, S.RUNNING)
            self.running.append(seq)
        self.ready.clear()
        budget = self.max_num_batched_tokens
        bm = self.block_manager
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            while not bm.can_append(seq):
                victim = self._victim(i)
                if victim is None:
                    break
                self.running.remove(victim)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.state != S.RUNNING:
                break  # seq itself was the victim: everything after it went too
            if not bm.can_append(seq):
                i += 1  # no victim left to make room: it waits for the next step
                continue
            bm.append_slots(seq)
            budget -= self._take(out, seq, budget)
            i += 1
        if out.preempted:
            return out
        self.admit_remote()   # seats and blocks freed since: remote ones need no budget
        while self.waiting and self.num_seats_taken < self.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            if not bm.allocate(seq):
                break
            advance(seq, S.ALLOCATED)
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.perf_counter()
            if seq.kv_remote:
                self.waiting.popleft()
                self._enter_remote(seq)
                continue
            if not self.enable_chunked_prefill and len(seq) - seq.num_computed_tokens > budget:
                bm.free(seq)
                advance(seq, S.WAITING)
                break
            self.waiting.popleft()
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = seq.num_computed_tokens
            advance(seq, S.RUNNING)
            self.running.append(seq)
            budget -= self._take(out, seq, budget)
        return out

    def admit_remote(self) -> None:
        """Admit the kv_remote sequences of the waiting queue into KV_REMOTE now, in order,
        without a step (their KV is computed elsewhere: they need no step budget, so they
        need not wait behind local prefills that do, which would leave the prefill node
        idle while this node computes). One passes the local sequences ahead of it only
        with what those leave: a seat each and the blocks of its whole prompt are kept for
        them, and one free block per running or ready sequence (their next tokens come
        first, as in a step). Stops at the first kv_remote sequence that does not fit
        (FIFO among them). Touches no running sequence, so it may run while a step's
        forward pass does (common/engine/async_engine.py)."""
        bm = self.block_manager
        kept_seats = kept_blocks = 0
        for seq in list(self.waiting):
            if not seq.kv_remote:
                kept_seats += 1
                kept_blocks += bm.num_blocks_for(len(seq))
                continue
            reserve = len(self.running) + len(self.ready) + kept_blocks
            if (self.num_seats_taken + kept_seats >= self.max_num_seqs
                    or bm.num_blocks_for(len(seq)) + reserve > bm.num_free_blocks or not bm.allocate(seq)):
                return
            self.waiting.remove(seq)
            advance(seq, S.ALLOCATED)
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.perf_counter()
            self._enter_remote(seq)

    def _enter_remote(self, seq: Sequence) -> None:
        """ALLOCATED -> KV_REMOTE; on_remote_admit is told."""
        seq.num_cached_tokens = seq.num_computed_tokens
        advance(seq, S.KV_REMOTE)
        self.remote[seq.request_id] = seq
        if self.on_remote_admit is not None:
            self.on_remote_admit(seq)

    def _victim(self, i: int) -> Sequence | None:
        """The newest running sequence at index >= i that may be preempted."""
        for seq in reversed(self.running[i:]):
            if not seq.hold_blocks:
                return seq
        return None

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
        """RUNNING -> WAITING, blocks freed; recomputed here (never remote again)."""
        self.block_manager.free(seq)
        advance(seq, S.WAITING)
        seq.num_computed_tokens = 0
        seq.kv_remote = False
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def kv_landed(self, seq: Sequence, num_tokens: int) -> None:
        """KV_REMOTE -> KV_READY: its blocks hold the KV of its first num_tokens tokens."""
        del self.remote[seq.request_id]
        advance(seq, S.KV_READY)
        seq.kv_remote = False
        seq.num_computed_tokens = num_tokens
        self.block_manager.cache_full_blocks(seq)
        self.ready.append(seq)

    def kv_failed(self, seq: Sequence, writer_settled: bool) -> None:
        """The remote fill failed. Writer settled: compute here, in the same blocks, past the
        local hit (KV_READY). Unconfirmed: the blocks are quarantined and seq waits again,
        at the front, to be computed here in fresh blocks."""
        if writer_settled:
            self.kv_landed(seq, seq.num_computed_tokens)
            return
        del self.remote[seq.request_id]
        self._quarantine(seq.request_id, Quarantine(seq.block_ids, None))
        seq.block_ids, seq.block_hashes = [], []
        seq.num_computed_tokens = 0
        seq.kv_remote = False
        advance(seq, S.WAITING)
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """RUNNING or KV_READY -> FINISHED (blocks freed) or HELD (hold_blocks)."""
        if seq.state == S.KV_READY:
            self.ready.remove(seq)
        else:
            self.running.remove(seq)
        seq.finish_reason = reason
        if seq.hold_blocks:
            advance(seq, S.HELD)
            self.held[seq.request_id] = seq
            return
        self.block_manager.free(seq)
        advance(seq, S.FINISHED)

    def release(self, request_id: str) -> bool:
        """HELD -> FINISHED, blocks freed. False if it is not held."""
        seq = self.held.pop(request_id, None)
        if seq is None:
            return False
        self.block_manager.free(seq)
        advance(seq, S.FINISHED)
        return True

    def abort(self, seq: Sequence, writer_settled: bool = True) -> None:
        """Any live state -> ABORTED, blocks freed; a KV_REMOTE one whose writer has not
        confirmed it stopped -> QUARANTINED (blocks kept until release_quarantine)."""
        state = seq.state
        if state == S.WAITING:
            self.waiting.remove(seq)
        elif state == S.RUNNING:
            self.running.remove(seq)
        elif state == S.KV_READY:
            self.ready.remove(seq)
        elif state == S.KV_REMOTE:
            del self.remote[seq.request_id]
        elif state == S.HELD:
            del self.held[seq.request_id]
        seq.finish_reason = "abort"
        if state == S.KV_REMOTE and not writer_settled:
            advance(seq, S.QUARANTINED)
            self._quarantine(seq.request_id, Quarantine(seq.block_ids, seq))
            seq.block_ids, seq.block_hashes = [], []
            return
        if seq.block_ids:
            self.block_manager.free(seq)
        advance(seq, S.ABORTED)

    def release_quarantine(self, request_id: str) -> bool:
        """Free the blocks quarantined under request_id (QUARANTINED -> ABORTED); False if
        there are none (released already)."""
        q = self.quarantined.pop(request_id, None)
        if q is None:
            return False
        self.num_quarantined_blocks -= len(q.block_ids)
        self.block_manager.free_blocks(q.block_ids)
        if q.seq is not None:
            advance(q.seq, S.ABORTED)
        return True

    def _quarantine(self, request_id: str, q: Quarantine) -> None:
        assert request_id not in self.quarantined, f"{request_id} is quarantined already"
        self.quarantined[request_id] = q
        self.num_quarantined_blocks += len(q.block_ids)
