"""Which KV blocks each node probably holds: per node, an LRU set of block hashes of the
requests routed to it, bounded by the node's number of KV blocks.

A node's prefix cache keeps the blocks of recent requests and evicts the least recently
used; this index mirrors that from the routing side only (no node reports), so it is an
approximation: it learns a prefix the moment a request is routed (no heartbeat delay),
but it cannot see evictions caused by other pressure on the node (the engine may evict
sooner than the bound says) or blocks the node made by decoding. A wrong guess costs
only a prefill, never correctness: the node checks its own cache on admission.

    hashes of one request:  h0 h1 h2 ... hn      (common.hashing chain, full blocks)
    recorded tail first, so h0 is the most recent and is evicted last: a prefix is
    lost from its end, and prefix_hit (count of leading hashes held) stays meaningful.

Thread-safety: event loop only.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

DEFAULT_CAPACITY = 4096


class PrefixIndex:
    def __init__(self) -> None:
        self._by_node: dict[str, OrderedDict[bytes, None]] = {}

    def prefix_hit(self, node_id: str, block_hashes: Sequence[bytes]) -> int:
        """Number of leading block_hashes the node is believed to hold. Read-only."""
        held = self._by_node.get(node_id)
        if not held:
            return 0
        num = 0
        for h in block_hashes:
            if h not in held:
                break
            num += 1
        return num

    def record(self, node_id: str, block_hashes: Sequence[bytes], capacity: int = 0) -> None:
        """The node now holds block_hashes (most recently used); evicts past capacity
        (0 = DEFAULT_CAPACITY)."""
        if not block_hashes:
            return
        held = self._by_node.setdefault(node_id, OrderedDict())
        for h in reversed(block_hashes):
            held[h] = None
            held.move_to_end(h)
        limit = capacity if capacity > 0 else DEFAULT_CAPACITY
        while len(held) > limit:
            held.popitem(last=False)

    def num_blocks(self, node_id: str) -> int:
        return len(self._by_node.get(node_id, ()))

    def forget(self, node_id: str) -> None:
        """Drop everything known about the node (it restarted or was removed)."""
        self._by_node.pop(node_id, None)
