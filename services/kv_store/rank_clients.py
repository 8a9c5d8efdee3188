"""A tensor-parallel node's handle on the kv-store: one KVStoreClient per rank, used as one.

Rank r holds KV heads [head_offset_r, head_offset_r + h) of every block, in its own
process. So each rank stores and loads its own heads, in a key space of its own
(KeySpace.head_offset), through a client whose sender moves that rank's cache (rank 0's
KVSender, a worker's WorkerSender); the hash chain is the node's, the same for all.

    pin      every rank's PinGet; the leading hits are those every rank holds (a rank's
             space evicts on its own), and none when any rank's pin failed (the others
             are released)
    fetch    every rank reads its slots at once, and returns only once every read ended;
             the load counts only if all did. A rank's read that raised may have left
             bytes in flight: its pin is marked unsettled
    release  every pin; the read is valid only if every rank's was
    put      one rank per distinct head offset (ranks that replicate heads share a space)

What StorePrefix (services/prefill/store_prefix.py) needs of a client, with the same
contract as KVStoreClient: any failure is a miss, an unsettled read marks the pins
unsettled. A node at TP 1 uses its KVStoreClient directly.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from services.kv_store.client import KVStoreClient, Pinned

log = logging.getLogger("pdmesh.kv_store.client")


@dataclass
class RankPins:
    """Every rank's pin of one prompt's leading hits (rank 0 first)."""

    pins: list[Pinned]

    @property
    def slot_ids(self) -> list[int]:
        """Rank 0's slots of the blocks every rank holds (their number is what counts)."""
        n = min(len(p.slot_ids) for p in self.pins)
        return self.pins[0].slot_ids[:n]

    @property
    def unsettled(self) -> bool:
        return any(p.unsettled for p in self.pins)


class RankStoreClients:
    def __init__(self, clients: Sequence[KVStoreClient]):
        """clients: one per rank, rank 0 first, on the same store."""
        self.clients = list(clients)
        first = self.clients[0]
        self.address, self.timeouts, self.block_size = first.address, first.timeouts, first.block_size
        seen: set[int] = set()
        self.putting = []   # the first client of each head offset
        for c in self.clients:
            if c.space.head_offset not in seen:
                seen.add(c.space.head_offset)
                self.putting.append(c)

    async def answers(self, timeout_s: float) -> bool:
        return await self.clients[0].answers(timeout_s)

    async def pin(self, hashes: Sequence[bytes], token_ids: Sequence[int]) -> RankPins | None:
        pins = await asyncio.gather(*(c.pin(hashes, token_ids) for c in self.clients), return_exceptions=True)
        if all(isinstance(p, Pinned) for p in pins):
            return RankPins(list(pins))
        await self._release_all([(c, p) for c, p in zip(self.clients, pins) if isinstance(p, Pinned)])
        return None

    async def fetch(self, pinned: RankPins, first: int, last: int, block_ids: Sequence[int]) -> bool:
        done = await asyncio.gather(*(c.fetch(p, first, last, block_ids)
                                      for c, p in zip(self.clients, pinned.pins)), return_exceptions=True)
        for p, d in zip(pinned.pins, done):
            if isinstance(d, BaseException):   # it may have left bytes in flight
                log.warning("a tensor-parallel rank's kv-store read raised %s: %s", type(d).__name__, d)
                p.unsettled = True
        return all(d is True for d in done)

    async def release(self, pinned: RankPins) -> bool:
        return await self._release_all(list(zip(self.clients, pinned.pins)))

    @staticmethod
    async def _release_all(pins: Sequence[tuple[KVStoreClient, Pinned]]) -> bool:
        """Release each (client, pin); True when every one was valid (a release that raised
        was not: the pin's lease ends it)."""
        valid = await asyncio.gather(*(c.release(p) for c, p in pins), return_exceptions=True)
        return all(v is True for v in valid)

    async def put(self, block_ids: Sequence[int], hashes: Sequence[bytes], token_ids: Sequence[int]) -> int:
        """Blocks written into every head offset's space, at least (the min; a put that
        raised wrote none)."""
        written = await asyncio.gather(*(c.put(block_ids, hashes, token_ids) for c in self.putting),
                                       return_exceptions=True)
        return min(w if isinstance(w, int) else 0 for w in written)

    async def close(self) -> None:
        for c in self.clients:
            await c.close()
