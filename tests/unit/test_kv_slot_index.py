"""SlotIndex: reservations, commits, pins, leases and watermark eviction, exactly."""
from __future__ import annotations

import pytest

from services.kv_store.slot_index import SlotIndex


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def toks(i: int) -> tuple[int, ...]:
    return (i, i + 1)


def put(index: SlotIndex, ids: list[int]) -> list[tuple[int, int]]:
    put_id, placed, _ = index.reserve([h(i) for i in ids], [toks(i) for i in ids])
    index.commit(put_id)
    return placed


@pytest.fixture
def clock():
    return Clock()


def test_reserve_takes_lowest_free_slots_and_commit_makes_them_findable(clock):
    index = SlotIndex(8, clock=clock)
    put_id, placed, evicted = index.reserve([h(1), h(2), h(3)], [toks(1), toks(2), toks(3)])
    assert placed == [(0, 0), (1, 1), (2, 2)] and evicted == []
    assert index.lookup([h(1), h(2)]) == 0          # reserved blocks are not visible
    assert index.pin([h(1)], [toks(1)]) == ("", [])
    assert len(index.commit(put_id)) == 3
    assert index.lookup([h(1), h(2), h(3), h(4)]) == 3
    assert index.lookup([h(2), h(3)]) == 2
    with pytest.raises(KeyError):
        index.commit(put_id)


def test_reserve_skips_held_and_repeated_hashes(clock):
    index = SlotIndex(8, clock=clock)
    put(index, [1, 2])
    put_id, placed, _ = index.reserve([h(1), h(3), h(3), h(2), h(4)],
                                      [toks(1), toks(3), toks(3), toks(2), toks(4)])
    assert placed == [(1, 2), (4, 3)]
    assert index.reserve([h(3)], [toks(3)])[0] == ""    # reserved counts as held
    index.commit(put_id)
    assert index.num_used == 4


def test_past_high_watermark_evicts_lru_down_to_low(clock):
    index = SlotIndex(10, high_watermark=0.8, low_watermark=0.5, clock=clock)
    for i in range(8):
        put(index, [i])
    assert index.num_used == 8 and index.num_evictions == 0
    pin_id, slots = index.pin([h(0)], [toks(0)])       # 0 becomes most recently used
    assert slots == [0]
    index.release(pin_id)
    put_id, placed, evicted = index.reserve([h(100)], [toks(100)])
    # 9 would pass 8 -> evict LRU (1, 2, 3, 4) until 4 + 1 <= 5
    assert [e.block_hash for e in evicted] == [h(1), h(2), h(3), h(4)]
    assert placed == [(0, 1)]
    index.commit(put_id)
    assert index.num_used == 5 and index.num_evictions == 4
    assert index.lookup([h(0)]) == 1 and index.lookup([h(1)]) == 0


def test_pinned_blocks_are_never_evicted(clock):
    index = SlotIndex(4, high_watermark=1.0, low_watermark=0.25, clock=clock)
    put(index, [0, 1, 2, 3])
    pin_id, slots = index.pin([h(0), h(1)], [toks(0), toks(1)])
    assert slots == [0, 1]
    _, placed, evicted = index.reserve([h(10), h(11), h(12)], [toks(10), toks(11), toks(12)])
    assert [e.block_hash for e in evicted] == [h(2), h(3)]
    assert placed == [(0, 2), (1, 3)]                  # only 2 slots could be freed
    assert index.lookup([h(0), h(1)]) == 2
    assert index.num_pinned == 2
    index.release(pin_id)
    assert index.num_pinned == 0


def test_pin_stops_at_token_mismatch(clock):
    index = SlotIndex(4, clock=clock)
    put(index, [0, 1])
    assert index.pin([h(0), h(1)], [toks(0), (9, 9)])[1] == [0]


def test_uncommitted_reservation_expires_and_its_slots_cool_before_reuse(clock):
    index = SlotIndex(4, reserve_ttl_s=30, clock=clock, cool_s=5)
    put_id, placed, _ = index.reserve([h(1), h(2)], [toks(1), toks(2)])
    clock.now += 29.9
    assert index.expire() == (0, 0)
    clock.now += 0.2
    assert index.expire() == (1, 0)
    assert index.num_expired_reservations == 1
    with pytest.raises(KeyError):
        index.commit(put_id)
    # a writer that outlived the lease may still land in slots 0 and 1: not handed out yet
    assert index.num_used == 2 and index.reserve([h(1)], [toks(1)])[1] == [(0, 2)]
    clock.now += 5
    index.expire()
    assert index.num_used == 1 and index.reserve([h(3)], [toks(3)])[1] == [(0, 0)]


def test_generations_tell_a_read_that_overlapped_a_reuse(clock):
    index = SlotIndex(1, high_watermark=1.0, low_watermark=1.0, pin_ttl_s=10, clock=clock)
    put_id, placed, _ = index.reserve([h(1)], [toks(1)])
    index.commit(put_id)
    pin_id, slots = index.pin([h(1)], [toks(1)])
    gens = [index.generations[s] for s in slots]
    assert index.unchanged(slots, gens)
    clock.now += 11
    index.expire()                                   # the pin lapsed: slot 0 is evictable
    assert index.unchanged(slots, gens)              # still the same block: the read is good
    index.commit(index.reserve([h(2)], [toks(2)])[0])  # evicts h(1), slot 0 gets h(2)
    assert not index.unchanged(slots, gens)


def test_pin_lease_ends_and_block_becomes_evictable(clock):
    index = SlotIndex(2, high_watermark=1.0, low_watermark=0.5, pin_ttl_s=10, clock=clock)
    put(index, [0, 1])
    index.pin([h(0), h(1)], [toks(0), toks(1)])
    assert index.reserve([h(5)], [toks(5)])[1] == []   # everything pinned
    clock.now += 10
    assert index.expire() == (0, 1)
    _, placed, evicted = index.reserve([h(5)], [toks(5)])
    assert [e.block_hash for e in evicted] == [h(0), h(1)]  # 0 + 1 <= low (1 slot)
    assert placed == [(0, 0)]


def test_insert_committed_is_findable_at_once(clock):
    index = SlotIndex(2, clock=clock)
    entry, evicted = index.insert_committed(h(7), toks(7))
    assert (entry.slot, evicted) == (0, [])
    assert index.lookup([h(7)]) == 1
    assert index.insert_committed(h(7), toks(7)) == (None, [])


@pytest.mark.parametrize("low, high", [(0.0, 0.5), (0.8, 0.5), (0.5, 1.5)])
def test_bad_watermarks_are_rejected(low, high):
    with pytest.raises(ValueError, match="watermarks"):
        SlotIndex(4, high_watermark=high, low_watermark=low)
