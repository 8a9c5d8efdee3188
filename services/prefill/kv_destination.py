"""Where a prefill's KV writes go: one batched write into the decode node's cache, or, at
tensor parallelism, one from each of this node's ranks into the decode rank that holds
its heads (common/transfer/tp_pairing.py).

    prefill TP p, decode TP d      rank pairs (src -> dst, head offset)
    p = d = 1                      0 -> 0                      whole blocks
    p = d                          i -> i                      whole blocks, per rank
    p = k * d                      i -> i // k at (i % k) * h  head slices (a write per
                                                               token slot: kv_writes.py)
                                   staged (a prefill node's    rank 0 gathers every rank's
                                   default: StagedWrites)      heads of the batch between
                                                               steps and writes whole
                                                               blocks to each decode rank

KVPusher (kv_push.py) calls write() on an executor thread for each batch it decides (blocks,
layers); a sharded write sends the worker ranks their orders first (rank_writes.py), makes
rank 0's own, then waits for all: it returns only when every rank's bytes were
acknowledged, and on any failure raises once all have ended or been given up on
(unsettled when any may still land), so the pusher's stop / settled logic holds for every
rank alike. One gap: a worker's write given up on (no answer in time) may still be reading
its source blocks after the pusher's settle() returned; its destination blocks stay
quarantined on the decode node (unsettled), so what it writes there is never used.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from common.parallel.rank_writes import RankWriters, WriteOrder
from common.transfer.base import TransferError
from common.transfer.kv_writes import KVSender
from common.transfer.layout import KVLayout
from common.transfer.tp_pairing import rank_writes


class OneRankWrites:
    """Both nodes at TP 1: the node's sender into the decode node's one cache."""

    def __init__(self, sender: KVSender, peer: str, layout: KVLayout):
        self.sender, self.peer, self.layout = sender, peer, layout

    def write(self, src: Sequence[int], dst: Sequence[int], layers: tuple[int, ...] | None,
              last_block_tokens: int | None, timeout_s: float) -> int:
        return self.sender.send_blocks(self.peer, self.layout, src, dst, layers=layers,
                                       last_block_tokens=last_block_tokens, timeout_s=timeout_s)


@dataclass(frozen=True)
class RankTarget:
    """Prefill rank `src` writes into the decode rank at `peer` (laid out as `layout`),
    from head `head_offset` (None: the same heads, whole blocks)."""

    src: int
    peer: str
    layout: KVLayout
    head_offset: int | None


def rank_targets(own: Sequence[KVLayout], dest: Sequence[tuple[str, KVLayout]]) -> list[RankTarget]:
    """own: this node's rank layouts (rank 0 first); dest: the decode node's (endpoint,
    layout) per rank. ValueError, in words, for a pair that cannot be served."""
    p, d = len(own), len(dest)
    pairs = rank_writes(p, own[0].num_kv_heads, d, dest[0][1].num_kv_heads)
    return [RankTarget(w.src, dest[w.dst][0], dest[w.dst][1], None if p == d else w.head_offset) for w in pairs]


class RankPairWrites:
    """Either node at TP > 1: every rank of this node writes its share."""

    def __init__(self, sender: KVSender, writers: RankWriters | None, targets: list[RankTarget]):
        if writers is None and any(t.src > 0 for t in targets):
            raise ValueError("worker ranks without KV writers cannot push their heads")
        self.sender, self.writers, self.targets = sender, writers, targets

    def write(self, src: Sequence[int], dst: Sequence[int], layers: tuple[int, ...] | None,
              last_block_tokens: int | None, timeout_s: float) -> int:
        """Every rank's share; ends by now + 3 x timeout_s at the latest (a worker's order
        starts within timeout_s or not at all, then ends within 2 x timeout_s)."""
        not_after = time.monotonic() + timeout_s
        orders = []
        for t in self.targets:
            if t.src > 0:
                order = WriteOrder(t.peer, t.layout, tuple(src), tuple(dst), layers, last_block_tokens,
                                   timeout_s, t.head_offset, not_after)
                orders.append((order, self.writers.write(t.src, order)))
        errors: list[TransferError] = []
        total = 0
        for t in self.targets:
            if t.src == 0:
                try:
                    total += self.sender.send_blocks(t.peer, t.layout, src, dst, layers=layers,
                                                     last_block_tokens=last_block_tokens, timeout_s=timeout_s,
                                                     head_offset=t.head_offset)
                except Exception as e:   # the workers' writes are still waited for
                    errors.append(as_transfer_error(e))
        for order, future in orders:
            try:
                total += self.writers.wait(future, order)
            except Exception as e:
                errors.append(as_transfer_error(e))
        if errors:
            raise TransferError("; ".join(dict.fromkeys(str(e) for e in errors)),
                                unsettled=any(e.unsettled for e in errors))
        return total


def as_transfer_error(e: Exception) -> TransferError:
    """A TransferError as it is; a plan's ValueError wrote nothing (settled); anything else
    may have left bytes in flight (unsettled)."""
    if isinstance(e, TransferError):
        return e
    return TransferError(str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}",
                         unsettled=not isinstance(e, ValueError))


@dataclass(frozen=True)
class Staging:
    """What a prefill node at TP > 1 stages with (services/node/engine_node.py)."""

    pool: StagingPool
    gather: Callable[[list[int]], list]            # block ids -> every rank's KV of them
    sender_for: Callable[[object], KVSender]       # a registered staging cache -> its sender


def destination_writes(sender: KVSender, writers: RankWriters | None, own: Sequence[KVLayout],
                       dest: Sequence[tuple[str, KVLayout]], staging: Staging | None = None):
    """The writes from this node's ranks (own: layouts, rank 0 first) into a decode node's
    (dest: endpoint and layout per rank): OneRankWrites, RankPairWrites, or, for head
    slices when staging is given, StagedWrites. ValueError, naming what does not fit, for
    rank counts that cannot be paired or layouts that differ (dtype, layers, block size,
    head_dim; heads, unless a head slice is written)."""
    if len(own) == 1 and len(dest) == 1:
        own[0].check_compatible(dest[0][1])
        return OneRankWrites(sender, *dest[0])
    targets = rank_targets(own, dest)
    for t in targets:
        own[t.src].check_compatible(t.layout, same_heads=t.head_offset is None)
    slices = RankPairWrites(sender, writers, targets)
    if staging is None or len(own) == len(dest):
        return slices
    return StagedWrites(staging.gather, staging.sender_for, staging.pool, slices, dest, len(own) // len(dest))


class StagingPool:
    """Registered staging blocks of every KV head, for pushes that would otherwise write
    head slices: [num_layers, 2, num_blocks, block_size, all heads, head_dim] worth of
    bytes, viewed per decode TP size d as d caches of the decode ranks' heads. A batch
    takes a run of consecutive blocks (one write per layer and K/V for the run) and gives
    it back once its write ended settled. Thread-safe."""

    def __init__(self, buffer, num_layers: int, num_blocks: int, block_size: int, num_heads: int, head_dim: int):
        self.buffer = buffer                        # flat, registered with the transfer engine
        self.shape = (num_layers, 2, num_blocks, block_size, num_heads, head_dim)
        self.num_blocks = num_blocks
        self._free = [True] * num_blocks
        self._lock = threading.Lock()
        self.num_staged = 0        # blocks staged so far (EngineStats.kv_blocks_staged)

    def caches(self, d: int) -> list:
        """The d decode ranks' staging caches [L, 2, N, block_size, heads / d, head_dim]."""
        L, two, n, bs, h, dim = self.shape
        return list(self.buffer.view(d, L, two, n, bs, h // d, dim).unbind(0))

    def take(self, n: int) -> int | None:
        """The first of n consecutive free blocks, now taken; None when there is no such run."""
        with self._lock:
            run = 0
            for i, free in enumerate(self._free):
                run = run + 1 if free else 0
                if run == n:
                    start = i - n + 1
                    self._free[start:i + 1] = [False] * n
                    self.num_staged += n
                    return start
        return None

    def give_back(self, start: int, n: int) -> None:
        with self._lock:
            self._free[start:start + n] = [True] * n


@dataclass(frozen=True)
class Staged:
    """A batch gathered into staging blocks [start, start + n)."""

    start: int
    n: int


class StagedWrites:
    """Prefill TP p = k * d, k > 1: instead of each rank writing its head slices (a write
    per token slot: 256 per block in bench/transfer.py --tp, 0.03x the bandwidth), rank 0
    gathers every rank's KV of the batch's blocks between steps (one collective,
    common/parallel/executor.gather_kv), assembles each decode rank's heads into staging
    blocks and writes them as whole blocks: one write per layer and K/V per decode rank.
    stage() runs on the step thread after the step (KVPusher in chunk mode: a gather
    cannot run inside the forward pass); write() on an executor thread. When the pool has
    no run of free blocks left, the batch falls back to the head-slice writes."""

    staged = True

    def __init__(self, gather, sender_for, pool: StagingPool, slices: RankPairWrites,
                 dest: Sequence[tuple[str, KVLayout]], k: int):
        """gather(block_ids) -> every rank's [L, 2, n, bs, h_p, D] (rank 0 first);
        sender_for(cache) -> a KVSender over that registered staging cache."""
        self.gather, self.pool, self.slices, self.dest, self.k = gather, pool, slices, dest, k
        self.caches = pool.caches(len(dest))
        self.senders = [sender_for(c) for c in self.caches]

    def stage(self, src: Sequence[int]):
        """Step thread: src gathered into staging blocks (a Staged), or src itself when the
        pool is full."""
        start = self.pool.take(len(src))
        if start is None:
            return src
        try:
            parts = self.gather(list(src))
        except BaseException:
            self.pool.give_back(start, len(src))
            raise
        for rank, part in enumerate(parts):
            j, i = divmod(rank, self.k)
            h = part.shape[4]
            self.caches[j][:, :, start:start + len(src), :, i * h:(i + 1) * h].copy_(part)
        return Staged(start, len(src))

    def discard(self, staged) -> None:
        """A staged batch that will not be written."""
        if isinstance(staged, Staged):
            self.pool.give_back(staged.start, staged.n)

    def write(self, src, dst: Sequence[int], layers: tuple[int, ...] | None,
              last_block_tokens: int | None, timeout_s: float) -> int:
        if not isinstance(src, Staged):
            return self.slices.write(src, dst, layers, last_block_tokens, timeout_s)
        ids = list(range(src.start, src.start + src.n))
        errors: list[TransferError] = []
        total = 0
        for sender, (peer, layout) in zip(self.senders, self.dest):
            try:
                total += sender.send_blocks(peer, layout, ids, dst, layers=layers,
                                            last_block_tokens=last_block_tokens, timeout_s=timeout_s)
            except Exception as e:
                errors.append(as_transfer_error(e))
        if not any(e.unsettled for e in errors):   # nothing can still read the staging blocks
            self.discard(src)
        if errors:
            raise TransferError("; ".join(dict.fromkeys(str(e) for e in errors)),
                                unsettled=any(e.unsettled for e in errors))
        return total
