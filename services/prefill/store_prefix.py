"""One prefill request's use of the kv-store (the RemoteKV of AsyncEngine.prefill).

    StorePrefix(...)     PinGet of the prompt's block chain starts at once, in parallel
                         with the engine admitting the request
    fill(block_ids, n)   engine admitted it with n tokens hit in its own prefix cache:
                         read the store's pinned blocks past those into block_ids, release
                         the pin (a read that outlived its pin is a miss); returns the
                         tokens that now hold KV
    (engine computes the rest; the KV push to decode sends every block alike)
    finish(put=True)     after the reply: write the blocks the store did not provide
                         (ReservePut skips those it holds), then the caller frees them

At least one prompt token is always left to compute (its logits give the first token).
Any store failure is a miss (KVStoreClient): the prompt is computed here. Except a read
that gave up with ranges still in flight (they may yet land in the blocks): fill raises,
cancel() answers False and settled() returns once the store has run (or been gone) for
timeouts.transfer_bound_s without a break, so the engine computes the prompt in fresh blocks and
quarantines these meanwhile. Otherwise
cancel() returns True once no read can land.
"""
from __future__ import annotations

import asyncio
import logging
import time

from common.engine.remote_kv import KVFilled
from common.transfer.base import TransferError
from common.hashing import hash_block_chain
from services.kv_store.client import KVStoreClient
from services.kv_store.rank_clients import RankStoreClients
from services.node.grpc_util import refuses_connections

log = logging.getLogger("pdmesh.prefill")
SETTLED_POLL_S = 0.5


class StorePrefix:
    def __init__(self, client: KVStoreClient | RankStoreClients, prompt: list[int], model_id: str, layout: str):
        self.client, self.prompt = client, prompt
        bs = self.block_size = client.block_size
        self.hashes = hash_block_chain(prompt, bs, model_id, layout)
        num_loadable = (len(prompt) - 1) // bs
        self._pin = asyncio.get_running_loop().create_task(
            client.pin(self.hashes[:num_loadable], prompt[:num_loadable * bs]))
        self.block_ids: list[int] = []
        self.num_loaded_blocks = 0          # from the store (past the local hits)
        self.num_cached_blocks = 0          # local hits + loaded: not computed here
        self._reading: asyncio.Future | None = None
        self._cancelled = False
        self._unsettled = False
        self._loading = False

    async def fill(self, block_ids: list[int], num_cached_tokens: int) -> KVFilled:
        self._loading = True
        self.block_ids = block_ids
        first = num_cached_tokens // self.block_size
        self.num_cached_blocks = first
        pinned = await self._pin
        if pinned is None:
            return KVFilled(num_cached_tokens)
        released = False
        try:
            last = len(pinned.slot_ids)
            if last <= first or self._cancelled:
                return KVFilled(num_cached_tokens)
            self._reading = asyncio.ensure_future(
                self.client.fetch(pinned, first, last, block_ids[first:last]))
            if not await self._reading:
                if pinned.unsettled:
                    self._unsettled = True
                    raise TransferError("a kv-store read gave up with ranges in flight")
                return KVFilled(num_cached_tokens)
            released = True
            if not await self.client.release(pinned):  # the slots changed during the read
                return KVFilled(num_cached_tokens)
        finally:
            if not released:
                asyncio.get_running_loop().create_task(self.client.release(pinned))
        self.num_loaded_blocks = last - first
        self.num_cached_blocks = last
        return KVFilled(last * self.block_size)

    async def cancel(self) -> bool:
        self._cancelled = True
        if self._reading is not None:
            await asyncio.wait([self._reading])
        return not self._unsettled

    async def settled(self) -> None:
        """After an unsettled read: its ranges come from the store, so none can land once
        the store has been running (answering) for transfer_bound_s without a break, or
        gone (its address refusing connections) that long. A stopped store does neither:
        the blocks stay quarantined (a time bound alone is what a stopped store outlasts),
        at most for timeouts.request_s (the longest a request lives) plus transfer_bound_s."""
        timeouts = self.client.timeouts
        bound = timeouts.transfer_bound_s
        latest = time.monotonic() + timeouts.request_s + bound
        since: tuple[str, float] | None = None     # ("answers" | "refuses", since when)
        while time.monotonic() < latest:
            if await self.client.answers(SETTLED_POLL_S):
                state = "answers"
            elif await refuses_connections(self.client.address, SETTLED_POLL_S):
                state = "refuses"
            else:
                state = None
            if state is None or since is None or since[0] != state:
                since = (state, time.monotonic()) if state else None
            elif time.monotonic() - since[1] >= bound:
                return
            await asyncio.sleep(SETTLED_POLL_S)
        log.warning("the kv-store at %s never answered again: freeing the blocks of an unsettled read",
                    self.client.address)

    async def finish(self, put: bool) -> int:
        """After the request: put the full blocks this node computed when `put` (returns how
        many were written), and drop the pin if load never ran (the request ended first)."""
        if not self._loading:
            pinned = await self._pin
            if pinned is not None:
                await self.client.release(pinned)
            return 0
        if not put or not self.block_ids or self._unsettled:
            return 0  # unsettled: the prompt was computed in other blocks than these
        first = self.num_cached_blocks if self.num_loaded_blocks else 0
        bs = self.block_size
        return await self.client.put(self.block_ids[first:len(self.hashes)], self.hashes[first:],
                                     self.prompt[first * bs:len(self.hashes) * bs])
