"""Which block lives in which slot of one key space's pool, and what may happen to it.

Life of a block in the store:

    (free slot) --reserve--> RESERVED (put_id, lease) --commit--> COMMITTED (findable, in LRU)
        RESERVED past its lease: dropped, slot free again (the writer gave up or died)
        COMMITTED and pinned (pin count > 0): never evicted; a pin ends by release or lease
        COMMITTED, unpinned: evicted least recently used first (pin = use) when the pool
            would pass its high watermark, down to its low watermark

Only COMMITTED blocks are found by lookup and pin, so a reader never sees a half-written
block. Every slot has a generation, bumped whenever it is given to a new block: a reader
that finishes after its pin lapsed checks the generations it was given (`unchanged`), so a
read that overlapped a reuse of its slots is detected and becomes a miss. The slots of an
expired reservation cool for `cool_s` (the transfer timeout) before reuse: a writer that
outlived its lease can no longer be writing when they get a new block. Watermarks count used slots (reserved + committed) out of num_slots:

    reserve(n): if used + n > high: evict LRU unpinned until used + n <= low (or nothing
    evictable is left); then take the n lowest free slots (low ids first, so one put
    tends to get consecutive slots and fewer transfer ranges)

Evicted entries are returned to the caller (to spill them to Redis) and their slots are
reused by the same call, so the caller must copy an evicted block's bytes before handing
the new slots out.

Pure bookkeeping: no memory, no I/O. Not thread-safe (the store's event loop owns it).
"""
from __future__ import annotations

import heapq
import itertools
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Callable


@dataclass(eq=False)
class Entry:
    block_hash: bytes
    slot: int
    token_ids: tuple[int, ...]
    committed: bool = False
    pins: int = 0


@dataclass
class Lease:
    expires_at: float
    hashes: list[bytes] = field(default_factory=list)


class SlotIndex:
    def __init__(self, num_slots: int, high_watermark: float = 0.9, low_watermark: float = 0.7,
                 reserve_ttl_s: float = 30.0, pin_ttl_s: float = 20.0,
                 clock: Callable[[], float] = time.monotonic, id_prefix: str = "",
                 cool_s: float = 10.0):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if not 0 < low_watermark <= high_watermark <= 1:
            raise ValueError(f"watermarks must satisfy 0 < low <= high <= 1, got "
                             f"low {low_watermark}, high {high_watermark}")
        self.num_slots = num_slots
        self.high_slots = max(1, int(high_watermark * num_slots))
        self.low_slots = max(1, int(low_watermark * num_slots))
        self.reserve_ttl_s, self.pin_ttl_s = reserve_ttl_s, pin_ttl_s
        self.clock = clock
        self.entries: dict[bytes, Entry] = {}
        self.lru: OrderedDict[bytes, None] = OrderedDict()   # committed, oldest use first
        self.free_slots: list[int] = list(range(num_slots))  # a heap
        self.generations: list[int] = [0] * num_slots
        self.cool_s = cool_s
        self.cooling: list[tuple[float, int]] = []           # (free again at, slot), a heap
        self.reservations: dict[str, Lease] = {}
        self.pins: dict[str, Lease] = {}
        self._ids = itertools.count(1)
        self.id_prefix = id_prefix
        self.num_evictions = self.num_expired_reservations = self.num_expired_pins = 0

    # ---- reading ------------------------------------------------------------------
    @property
    def num_used(self) -> int:
        """Slots not free: reserved, committed or cooling."""
        return self.num_slots - len(self.free_slots)

    def unchanged(self, slots: Sequence[int], generations: Sequence[int]) -> bool:
        """True if every slot still holds the block it held at those generations."""
        return len(slots) == len(generations) and all(
            0 <= s < self.num_slots and self.generations[s] == g for s, g in zip(slots, generations))

    @property
    def num_pinned(self) -> int:
        return sum(1 for e in self.entries.values() if e.pins)

    def lookup(self, hashes: Sequence[bytes]) -> int:
        """Number of leading hashes held committed. Read-only (no LRU touch)."""
        num = 0
        for h in hashes:
            entry = self.entries.get(h)
            if entry is None or not entry.committed:
                break
            num += 1
        return num

    # ---- put ----------------------------------------------------------------------
    def reserve(self, hashes: Sequence[bytes], token_ids: Sequence[tuple[int, ...]]
                ) -> tuple[str, list[tuple[int, int]], list[Entry]]:
        """Reserve slots for the hashes not held (committed or reserved). Returns
        (put_id or "" when nothing to write, [(index into hashes, slot)], evicted entries).
        Fewer slots than missing hashes when the pool is full of pinned or reserved blocks:
        the rest are skipped (a put is best effort)."""
        missing, seen = [], set()
        for i, h in enumerate(hashes):
            if h not in self.entries and h not in seen:
                seen.add(h)
                missing.append(i)
        evicted = self._make_room(len(missing))
        placed = []
        for i in missing:
            if not self.free_slots:
                break
            slot = self._take_slot()
            self.entries[hashes[i]] = Entry(hashes[i], slot, tuple(token_ids[i]))
            placed.append((i, slot))
        if not placed:
            return "", [], evicted
        put_id = f"{self.id_prefix}put-{next(self._ids)}"
        self.reservations[put_id] = Lease(self.clock() + self.reserve_ttl_s,
                                          [hashes[i] for i, _ in placed])
        return put_id, placed, evicted

    def commit(self, put_id: str) -> list[Entry]:
        """Make a reservation's blocks findable (most recently used). KeyError when the
        put_id is unknown or its lease expired."""
        lease = self.reservations.pop(put_id)
        committed = []
        for h in lease.hashes:
            entry = self.entries[h]
            entry.committed = True
            self.lru[h] = None
            committed.append(entry)
        return committed

    def insert_committed(self, block_hash: bytes, token_ids: tuple[int, ...]
                         ) -> tuple[Entry | None, list[Entry]]:
        """A block coming back from a lower tier: (its committed entry, evicted entries), or
        (None, evicted) when no slot can be freed. The caller fills the slot before
        anyone else runs (same event-loop turn)."""
        if block_hash in self.entries:
            return None, []
        evicted = self._make_room(1)
        if not self.free_slots:
            return None, evicted
        entry = Entry(block_hash, self._take_slot(), tuple(token_ids), committed=True)
        self.entries[block_hash] = entry
        self.lru[block_hash] = None
        return entry, evicted

    # ---- get ----------------------------------------------------------------------
    def pin(self, hashes: Sequence[bytes], token_ids: Sequence[tuple[int, ...]]) -> tuple[str, list[int]]:
        """Pin the leading committed hits whose tokens match; returns (pin_id or "", slots)."""
        slots = []
        for h, tokens in zip(hashes, token_ids):
            entry = self.entries.get(h)
            if entry is None or not entry.committed or entry.token_ids != tuple(tokens):
                break
            slots.append(entry.slot)
        if not slots:
            return "", []
        pin_id = self.new_pin()
        for h in hashes[:len(slots)]:
            self._pin_one(pin_id, h)
        return pin_id, slots

    def new_pin(self) -> str:
        """An empty pin (blocks join it through add_to_pin); it expires like any other."""
        pin_id = f"{self.id_prefix}pin-{next(self._ids)}"
        self.pins[pin_id] = Lease(self.clock() + self.pin_ttl_s)
        return pin_id

    def add_to_pin(self, pin_id: str, block_hash: bytes) -> None:
        """Pin one more committed block under an existing pin (a promoted block)."""
        self._pin_one(pin_id, block_hash)

    def _pin_one(self, pin_id: str, block_hash: bytes) -> None:
        entry = self.entries[block_hash]
        entry.pins += 1
        self.lru.move_to_end(block_hash)
        self.pins[pin_id].hashes.append(block_hash)

    def release(self, pin_id: str) -> bool:
        """End a pin; False when unknown (released already or expired)."""
        lease = self.pins.pop(pin_id, None)
        if lease is None:
            return False
        for h in lease.hashes:
            entry = self.entries.get(h)
            if entry is not None:
                entry.pins -= 1
        return True

    # ---- time and room --------------------------------------------------------------
    def expire(self) -> tuple[int, int]:
        """Drop reservations and pins past their lease; returns (reservations, pins)."""
        now = self.clock()
        self._uncool(now)
        stale_puts = [p for p, lease in self.reservations.items() if lease.expires_at <= now]
        for put_id in stale_puts:
            for h in self.reservations.pop(put_id).hashes:
                self._drop(self.entries[h], cool=True)
        stale_pins = [p for p, lease in self.pins.items() if lease.expires_at <= now]
        for pin_id in stale_pins:
            self.release(pin_id)
        self.num_expired_reservations += len(stale_puts)
        self.num_expired_pins += len(stale_pins)
        return len(stale_puts), len(stale_pins)

    def _make_room(self, num_needed: int) -> list[Entry]:
        """Evict past the watermarks, counting blocks held (reserved or committed): cooling
        slots are free again within cool_s, and no eviction frees them sooner."""
        self._uncool(self.clock())
        held = self.num_used - len(self.cooling)
        if held + num_needed <= self.high_slots:
            return []
        target = max(0, self.low_slots - num_needed)
        evicted = []
        for h in list(self.lru):
            if self.num_used - len(self.cooling) <= target:
                break
            entry = self.entries[h]
            if entry.pins:
                continue
            self._drop(entry)
            evicted.append(entry)
        self.num_evictions += len(evicted)
        return evicted

    def _drop(self, entry: Entry, cool: bool = False) -> None:
        del self.entries[entry.block_hash]
        self.lru.pop(entry.block_hash, None)
        if cool:
            heapq.heappush(self.cooling, (self.clock() + self.cool_s, entry.slot))
        else:
            heapq.heappush(self.free_slots, entry.slot)

    def _uncool(self, now: float) -> None:
        while self.cooling and self.cooling[0][0] <= now:
            heapq.heappush(self.free_slots, heapq.heappop(self.cooling)[1])

    def _take_slot(self) -> int:
        slot = heapq.heappop(self.free_slots)
        self.generations[slot] += 1
        return slot
