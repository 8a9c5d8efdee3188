"""Where a prefill's KV writes go: one batched write into the decode node's cache, or, at
tensor parallelism, one from each of this node's ranks into the decode rank that holds
its heads (common/transfer/tp_pairing.py).

    prefill TP p, decode TP d      rank pairs (src -> dst, head offset)
    p = d = 1                      0 -> 0                      whole blocks
    p = d                          i -> i                      whole blocks, per rank
    latent (MLA), any p, d         j % p -> j                  whole blocks: every rank
                                                               holds the same latent cache
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

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from common.parallel.rank_writes import RankWriters, WriteOrder
from common.transfer.base import TransferError
from common.transfer.kv_writes import KVSender
from common.kv_layout import KVLayout
from common.transfer.tp_pairing import rank_writes

log = logging.getLogger("pdmesh.prefill")


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
    latent = own[0].is_latent        # a decode cache of another kind: check_compatible refuses it
    pairs = rank_writes(p, own[0].num_kv_heads, d, dest[0][1].num_kv_heads, latent)
    whole = p == d or latent
    return [RankTarget(w.src, dest[w.dst][0], dest[w.dst][1], None if whole else w.head_offset) for w in pairs]


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
        raise_joined(errors)
        return total


def raise_joined(errors: list[TransferError]) -> None:
    """One TransferError for every rank's (unsettled when any is); nothing when none."""
    if errors:
        raise TransferError("; ".join(dict.fromkeys(str(e) for e in errors)),
                            unsettled=any(e.unsettled for e in errors))


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
    sync: Callable[[], None] | None = None         # on a device: wait for the staging copies


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
    if staging is None or len(own) == len(dest) or own[0].is_latent:
        return slices
    return StagedWrites(staging, slices, dest, len(own) // len(dest))


class StagingPool:
    """Registered staging blocks of every KV head (all layers, K and V), for pushes that
    would otherwise write head slices (a K/V cache's: a latent one is whole on every rank
    and never staged). A batch takes runs of consecutive free blocks;
    each run is its own bytes, viewed for a decode node of TP d as d caches
    [num_layers, 2, run length, block_size, heads / d, head_dim] (one write per layer and
    K/V per decode rank), so batches for decode nodes of different TP sizes never share
    bytes. A run comes back once its writes ended settled, or a transfer bound after an
    unsettled end (give_back_later). Thread-safe."""

    def __init__(self, buffer, num_layers: int, num_blocks: int, block_size: int, num_heads: int, head_dim: int):
        self.buffer = buffer                        # flat, registered with the transfer engine
        self.block_shape = (num_layers, 2, block_size, num_heads, head_dim)
        self.block_elems = num_layers * 2 * block_size * num_heads * head_dim
        self.num_blocks = num_blocks
        self._free = [True] * num_blocks
        self._lock = threading.Lock()
        self.num_staged = 0        # blocks staged so far (EngineStats.kv_blocks_staged)
        self.num_unstaged = 0      # blocks written as head slices: no free staging block

    def take(self, n: int) -> tuple[int, int] | None:
        """(start, length) of the first run of free blocks, at most n long, now taken;
        None when every block is taken."""
        with self._lock:
            for start, free in enumerate(self._free):
                if free:
                    end = start
                    while end < self.num_blocks and end - start < n and self._free[end]:
                        end += 1
                    self._free[start:end] = [False] * (end - start)
                    return start, end - start
        return None

    def caches(self, start: int, length: int, d: int) -> list:
        """The d decode ranks' staging caches of run [start, start + length)."""
        L, two, bs, h, dim = self.block_shape
        run = self.buffer[start * self.block_elems:(start + length) * self.block_elems]
        return list(run.view(d, L, two, length, bs, h // d, dim).unbind(0))

    def count_staged(self, n: int) -> None:
        with self._lock:
            self.num_staged += n

    def count_unstaged(self, n: int) -> bool:
        """Count n blocks left to head slices; True the first time."""
        with self._lock:
            self.num_unstaged += n
            return self.num_unstaged == n

    def give_back(self, start: int, length: int) -> None:
        with self._lock:
            self._free[start:start + length] = [True] * length

    def give_back_later(self, start: int, length: int, delay_s: float) -> None:
        """After an unsettled write: the engine may read the run for a while yet."""
        timer = threading.Timer(delay_s, self.give_back, (start, length))
        timer.daemon = True
        timer.start()


@dataclass(frozen=True)
class Staged:
    """A batch of source blocks: src[:len] of them gathered into staging runs
    (start, length) in order, the rest (`rest`, when the pool ran out) left for head-slice
    writes."""

    runs: tuple[tuple[int, int], ...]
    rest: tuple[int, ...]


class StagedWrites:
    """Prefill TP p = k * d, k > 1: instead of each rank writing its head slices (a write
    per token slot: 256 per block in bench/transfer.py --tp, 0.03x the bandwidth), rank 0
    gathers every rank's KV of the batch's blocks between steps (one collective,
    common/parallel/executor.gather_kv), assembles each decode rank's heads into staging
    blocks and writes them as whole blocks: one write per layer and K/V per decode rank
    and staging run, the decode ranks one after another. stage() runs on the step thread
    after the step (KVPusher in chunk mode: a gather cannot run inside the forward pass);
    write() on an executor thread. Blocks the pool has no room for go as head slices
    (counted: StagingPool.num_unstaged, and logged once)."""

    staged = True

    def __init__(self, staging: Staging, slices: RankPairWrites, dest: Sequence[tuple[str, KVLayout]], k: int):
        self.staging, self.pool, self.slices, self.dest, self.k = staging, staging.pool, slices, dest, k

    def stage(self, src: Sequence[int]) -> Staged:
        """Step thread: src gathered into staging runs, as many as the pool has room for."""
        runs: list[tuple[int, int]] = []
        taken = 0
        while taken < len(src) and (run := self.pool.take(len(src) - taken)) is not None:
            runs.append(run)
            taken += run[1]
        if taken < len(src):
            self._unstaged(len(src) - taken)
        if runs:
            try:
                parts = self.staging.gather(list(src[:taken]))
                at = 0
                for start, length in runs:
                    caches = self.pool.caches(start, length, len(self.dest))
                    for rank, part in enumerate(parts):
                        j, i = divmod(rank, self.k)
                        h = part.shape[4]
                        caches[j][:, :, :, :, i * h:(i + 1) * h].copy_(part[:, :, at:at + length])
                    at += length
                if self.staging.sync is not None:
                    self.staging.sync()    # the copies ran on the device's stream; the engine reads memory
            except BaseException:
                for run in runs:
                    self.pool.give_back(*run)
                raise
            self.pool.count_staged(taken)
        return Staged(tuple(runs), tuple(src[taken:]))

    def _unstaged(self, n: int) -> None:
        if self.pool.count_unstaged(n):
            log.warning("KV staging is full: %d block(s) pushed as head slices (one write per token slot); "
                        "more staging memory would keep them whole (STAGING_MAX_BYTES)", n)

    def discard(self, staged: Staged) -> None:
        """A staged batch that will not be written."""
        for run in staged.runs:
            self.pool.give_back(*run)

    def write(self, staged: Staged, dst: Sequence[int], layers: tuple[int, ...] | None,
              last_block_tokens: int | None, timeout_s: float) -> int:
        errors: list[TransferError] = []
        total, at = 0, 0
        for start, length in staged.runs:
            last = last_block_tokens if at + length == len(dst) else None
            caches = self.pool.caches(start, length, len(self.dest))
            run_errors = []
            for cache, (peer, layout) in zip(caches, self.dest):
                try:
                    total += self.staging.sender_for(cache).send_blocks(
                        peer, layout, range(length), dst[at:at + length], layers=layers,
                        last_block_tokens=last, timeout_s=timeout_s)
                except Exception as e:
                    run_errors.append(as_transfer_error(e))
            if any(e.unsettled for e in run_errors):   # the engine may still read the run
                self.pool.give_back_later(start, length, 2 * timeout_s)
            else:
                self.pool.give_back(start, length)
            errors += run_errors
            at += length
        if staged.rest:
            try:
                total += self.slices.write(staged.rest, dst[at:], layers, last_block_tokens, timeout_s)
            except Exception as e:
                errors.append(as_transfer_error(e))
        raise_joined(errors)
        return total
