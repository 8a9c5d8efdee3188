"""Where a prefill's KV writes go: one batched write into the decode node's cache, or, at
tensor parallelism, one from each of this node's ranks into the decode rank that holds
its heads (common/transfer/tp_pairing.py).

    prefill TP p, decode TP d      rank pairs (src -> dst, head offset)
    p = d = 1                      0 -> 0                      whole blocks
    p = d                          i -> i                      whole blocks, per rank
    p = k * d                      i -> i // k at (i % k) * h  head slices (a write per
                                                               token slot: kv_writes.py)

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

import time
from collections.abc import Sequence
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


def destination_writes(sender: KVSender, writers: RankWriters | None, own: Sequence[KVLayout],
                       dest: Sequence[tuple[str, KVLayout]]) -> OneRankWrites | RankPairWrites:
    """The writes from this node's ranks (own: layouts, rank 0 first) into a decode node's
    (dest: endpoint and layout per rank). ValueError, naming what does not fit, for rank
    counts that cannot be paired or layouts that differ (dtype, layers, block size,
    head_dim; heads, unless a head slice is written)."""
    if len(own) == 1 and len(dest) == 1:
        own[0].check_compatible(dest[0][1])
        return OneRankWrites(sender, *dest[0])
    targets = rank_targets(own, dest)
    for t in targets:
        own[t.src].check_compatible(t.layout, same_heads=t.head_offset is None)
    return RankPairWrites(sender, writers, targets)
