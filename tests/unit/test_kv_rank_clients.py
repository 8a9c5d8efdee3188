"""RankStoreClients (services/kv_store/rank_clients.py): a tensor-parallel node's kv-store
clients, one per rank, used as one. Each rank's client here is a stand-in that answers
as KVStoreClient would (pins, reads, releases, puts) or raises, so that every partial
failure can be made: the leading hits are those every rank holds, a pin is never left
behind, a read that raised marks its pin unsettled (its bytes may be in flight), and only
one rank per head offset puts."""
from __future__ import annotations

import asyncio

from protos.pdmesh.v1 import kv_store_pb2
from services.kv_store.client import Pinned
from services.kv_store.rank_clients import RankStoreClients


def pinned(slots: list[int]) -> Pinned:
    return Pinned("pin", slots, [0] * len(slots), "store:1", None, 1e18)


class Client:
    """One rank's client: pin gives `slots` (None: a miss), fetch answers `fetch` (True,
    False, or an exception to raise); records releases, fetches and puts."""

    def __init__(self, offset: int, slots: list[int] | None = None, fetch=True, put: int = 3):
        self.space = kv_store_pb2.KeySpace(head_offset=offset)
        self.address, self.timeouts, self.block_size = "store:1", None, 4
        self.slots, self.fetch_answer, self.put_answer = slots, fetch, put
        self.released, self.fetched, self.puts = [], [], []

    async def pin(self, hashes, token_ids):
        return None if self.slots is None else pinned(self.slots)

    async def fetch(self, p, first, last, block_ids):
        await asyncio.sleep(0.01 if self.fetch_answer is True else 0)
        self.fetched.append((p.slot_ids[first:last], list(block_ids)))
        if isinstance(self.fetch_answer, BaseException):
            raise self.fetch_answer
        return self.fetch_answer

    async def release(self, p):
        self.released.append(p.slot_ids)
        return True

    async def put(self, block_ids, hashes, token_ids):
        self.puts.append(list(block_ids))
        return self.put_answer


def test_the_leading_hits_are_those_every_rank_holds_and_each_reads_its_own_slots():
    a, b = Client(0, [5, 6, 7]), Client(2, [1, 2])
    clients = RankStoreClients([a, b])
    p = asyncio.run(clients.pin([b"h"] * 3, []))
    assert p.slot_ids == [5, 6] and not p.unsettled
    assert asyncio.run(clients.fetch(p, 0, 2, [10, 11]))
    assert (a.fetched, b.fetched) == ([([5, 6], [10, 11])], [([1, 2], [10, 11])])
    assert asyncio.run(clients.release(p))
    assert (a.released, b.released) == ([[5, 6, 7]], [[1, 2]])


def test_a_rank_that_misses_makes_it_a_miss_and_the_others_pins_are_released():
    a, b, c = Client(0, [5, 6]), Client(2, None), Client(4, [9])
    assert asyncio.run(RankStoreClients([a, b, c]).pin([b"h"] * 2, [])) is None
    assert (a.released, b.released, c.released) == ([[5, 6]], [], [[9]])


def test_a_read_that_raised_is_waited_for_with_the_others_and_leaves_its_pin_unsettled():
    a, b = Client(0, [5]), Client(2, [1], fetch=RuntimeError("engine gone"))
    clients = RankStoreClients([a, b])
    p = asyncio.run(clients.pin([b"h"], []))
    assert not asyncio.run(clients.fetch(p, 0, 1, [3]))
    assert a.fetched == [([5], [3])], "rank 0's read ran to its end before fetch returned"
    assert p.unsettled and p.pins[1].unsettled and not p.pins[0].unsettled


def test_a_read_that_failed_cleanly_is_a_miss_not_unsettled():
    a, b = Client(0, [5]), Client(2, [1], fetch=False)
    clients = RankStoreClients([a, b])
    p = asyncio.run(clients.pin([b"h"], []))
    assert not asyncio.run(clients.fetch(p, 0, 1, [3])) and not p.unsettled


def test_ranks_that_replicate_heads_put_once_per_head_offset():
    r0, r1, r2, r3 = Client(0, put=4), Client(0, put=4), Client(1, put=2), Client(1, put=9)
    assert asyncio.run(RankStoreClients([r0, r1, r2, r3]).put([1, 2], [b"h"] * 2, [])) == 2
    assert (r0.puts, r1.puts, r2.puts, r3.puts) == ([[1, 2]], [], [[1, 2]], [])
