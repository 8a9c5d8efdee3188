"""KV block allocation with prefix caching.

Every block has a ref count. A block whose ref count drops to zero goes to the free queue
but keeps its hash and tokens (it is still a prefix-cache entry) until the queue hands it
out again; then its hash is dropped (eviction). Allocation always takes the front of the
queue, so cached blocks are evicted in LRU order.

Free-queue order:
    front: never-used blocks (ascending ids), then freed blocks without a hash
    ...    freed blocks with a hash, oldest free first; a sequence's blocks are freed
    back:  tail first, so its prefix outlives its tail

Hashes are registered only once a full block's KV has been computed (`cache_full_blocks`),
so a prefix hit never reads a block that is still being written. A sequence that wants its
prompt's logits (prompt_logprobs: Sequence.wants_prompt_logits) gets no hit, as in vLLM;
its computed blocks are registered like any other's.

The new blocks of one allocation back the sequence in ascending id order, so a KV push of
them (common/transfer/kv_writes.py) needs one write per run of consecutive ids.

Not thread-safe: one thread at a time drives it, whoever holds the engine (AsyncEngine:
its step thread, or a caller between steps or inside a step's forward window).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from common.engine.sequence import Sequence
from common.hashing import block_hash


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None
    token_ids: tuple[int, ...] = field(default_factory=tuple)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, model_id: str = "", layout: str = "",
                 enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.block_size = block_size
        self.model_id, self.layout = model_id, layout
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[bytes, int] = {}
        self.num_hits = self.num_queries = 0
        self.num_cached_blocks = 0   # free blocks still holding a prefix-cache entry (kept as a count)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free or only held by the prefix cache)."""
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def num_blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    # ---- prefix lookup -------------------------------------------------------------
    def _prefix_hits(self, seq: Sequence) -> tuple[list[int], list[bytes]]:
        """Cached block ids and hashes for the longest computed prefix of seq, leaving at
        least one token to compute (its logits are needed). None for a sequence that wants
        its prompt's logits (Sequence.wants_prompt_logits): a hit would skip positions."""
        if not self.enable_prefix_caching or seq.wants_prompt_logits:
            return [], []
        bs, ids, hashes, parent = self.block_size, [], [], None
        for i in range((len(seq.token_ids) - 1) // bs):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = block_hash(parent, tokens, self.model_id, self.layout)
            block_id = self.hash_to_block.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            ids.append(block_id)
            hashes.append(h)
            parent = h
        return ids, hashes

    # ---- allocate / free -----------------------------------------------------------
    def can_allocate(self, seq: Sequence) -> bool:
        hit_ids, _ = self._prefix_hits(seq)
        reclaimed = sum(1 for b in hit_ids if self.blocks[b].ref_count == 0)
        needed = self.num_blocks_for(len(seq.token_ids)) - len(hit_ids)
        return needed + reclaimed <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> bool:
        """Give seq blocks for all its tokens, prefix hits first. Sets block_ids,
        block_hashes and num_computed_tokens. False (nothing changed) when there is no room."""
        assert not seq.block_ids, f"{seq.request_id} already holds blocks"
        if not self.can_allocate(seq):
            return False
        hit_ids, hashes = self._prefix_hits(seq)
        for block_id in hit_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_queue[block_id]
                self.num_cached_blocks -= 1
            block.ref_count += 1
        seq.block_ids = list(hit_ids)
        seq.block_hashes = list(hashes)
        num_new = self.num_blocks_for(len(seq.token_ids)) - len(hit_ids)
        # Which blocks are taken is the queue's (LRU) choice; in which order they back the
        # sequence is free, and ascending ids turn a freed sequence's blocks (queued tail
        # first) back into consecutive runs: one KV transfer write per run, not per block.
        seq.block_ids.extend(sorted(self._take_free() for _ in range(num_new)))
        seq.num_computed_tokens = len(hit_ids) * self.block_size
        self.num_queries += len(seq.token_ids)
        self.num_hits += seq.num_computed_tokens
        return True

    def can_append(self, seq: Sequence) -> bool:
        """Room for seq's tokens not yet backed by a block (at most one new block)."""
        return self.num_blocks_for(len(seq.token_ids)) - len(seq.block_ids) <= self.num_free_blocks

    def append_slots(self, seq: Sequence) -> None:
        """Add the blocks seq needs for all its tokens; call can_append first."""
        while len(seq.block_ids) < self.num_blocks_for(len(seq.token_ids)):
            seq.block_ids.append(self._take_free())

    def free(self, seq: Sequence) -> None:
        """Drop seq's references, tail block first. Hashed blocks stay cached."""
        self.free_blocks(seq.block_ids)
        seq.block_ids = []
        seq.block_hashes = []

    def free_blocks(self, block_ids: list[int]) -> None:
        """Drop one reference to each block, the last first (see free)."""
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"double free of block {block_id}"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block_id] = None
                if block.hash is None:
                    self.free_queue.move_to_end(block_id, last=False)
                else:
                    self.num_cached_blocks += 1

    def _take_free(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:
            self.num_cached_blocks -= 1
            if self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
            block.hash, block.token_ids = None, ()
        block.ref_count = 1
        return block_id

    # ---- prefix registration ------------------------------------------------------
    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the hashes of seq's blocks that are full and computed."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        parent = seq.block_hashes[-1] if seq.block_hashes else None
        for i in range(len(seq.block_hashes), seq.num_computed_tokens // bs):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = block_hash(parent, tokens, self.model_id, self.layout)
            block = self.blocks[seq.block_ids[i]]
            if block.hash is None and h not in self.hash_to_block:
                block.hash, block.token_ids = h, tokens
                self.hash_to_block[h] = block.block_id
            seq.block_hashes.append(h)
            parent = h

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (e.g. after weights change). Used blocks keep running."""
        for block in self.blocks:
            block.hash, block.token_ids = None, ()
        self.hash_to_block.clear()
        self.num_cached_blocks = 0
