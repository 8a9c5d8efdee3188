"""The kv-store's state: one pool per key space (model id x KV layout), each a SlotIndex
(bookkeeping) over a SlotMemory (registered bytes), plus the optional Redis tier.

    put:  reserve_put -> (the client writes the slots) -> commit_put
    get:  pin_get (memory hits, then Redis hits promoted into slots; with the slots'
          generations) -> (the client reads the slots) -> release, which says whether the
          slots still hold those blocks (else the read was a miss)
    expire() drops stale reservations and pins; the server calls it periodically.

Key spaces: one per (model id, space_key: the layout_key and, for a tensor-parallel rank's
heads, their head offset), each with its own pool of kv_store.capacity_mb
(a space fills and evicts only its own slots; a TP-N node's ranks fill N of them), at most
kv_store.max_spaces (model id, layout_key) pairs, however many head offsets each has. A new
one is made only for a model that a live member of the mesh serves with that layout
(`admit_space`, awaited by the servicer before a call that would make one; the members
come from the meta-server, services/node/members_view.py): so a caller cannot fill
max_spaces with bogus models and lock the real one out. A space stays once made.

Evicted blocks are copied out of their slots at once and spilled to Redis in the
background (their slots are reused by the same call). Errors: ValueError for bad
arguments (naming the field), KeyError for unknown put/pin ids, SpacesExhausted when a
new key space would pass max_spaces, SpaceRefused when no live member serves it.

Not thread-safe: the store's event loop owns it.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable

from common.config import KVStoreConfig, TimeoutConfig
from common.hashing import DIGEST_SIZE, layout_key
from common.transfer.base import TransferEngine
from common.kv_layout import KVLayout
from services.kv_store.pin_names import NAME, PinNames, check_name
from services.kv_store.redis_tier import RedisTier, decode_block, encode_block
from services.kv_store.slot_index import Entry, SlotIndex
from services.kv_store.slot_memory import SlotMemory
from services.node.members_view import MembersView

log = logging.getLogger("pdmesh.kv_store")

MAX_BLOCKS_PER_CALL = 8192


class SpacesExhausted(RuntimeError):
    """A new key space would pass kv_store.max_spaces."""


class SpaceRefused(RuntimeError):
    """No live member of the mesh serves this model with this layout."""


def space_key(layout: KVLayout, head_offset: int = 0) -> str:
    """The layout part of a key space: layout_key, plus the first KV head of a
    tensor-parallel rank's shard when it is not 0 (TP 1 and rank 0 keep the plain key).
    ValueError naming space.head_offset unless it is a multiple of the layout's heads."""
    if head_offset < 0 or head_offset % layout.num_kv_heads:
        raise ValueError(f"space.head_offset must be a non-negative multiple of layout.num_kv_heads "
                         f"({layout.num_kv_heads}), got {head_offset}")
    key = layout_key(layout)
    return f"{key}:O{head_offset}" if head_offset else key


def heads_offsets(member) -> range:
    """The head offsets a member's ranks may store under (NodeInfo: kv_layout heads per
    rank, one rank per kv_ranks entry, or one)."""
    heads = member.kv_layout.num_kv_heads
    return range(0, heads * max(len(member.kv_ranks), 1), max(heads, 1))


@dataclass
class Space:
    model_id: str
    key: str
    index: SlotIndex
    memory: SlotMemory


class KVStore:
    def __init__(self, cfg: KVStoreConfig, transfer: TransferEngine, redis: RedisTier | None = None,
                 clock: Callable[[], float] = time.monotonic, timeouts: TimeoutConfig = TimeoutConfig(),
                 members: MembersView | None = None):
        """members: who may have key spaces (see admit_space); None admits every model, for
        tests that drive the store itself (services/kv_store/server.py always gives one).
        close() closes it."""
        self.cfg, self.transfer, self.redis, self.clock = cfg, transfer, redis, clock
        self.timeouts = timeouts
        self.members = members
        self.spaces: dict[tuple[str, str], Space] = {}
        self._by_id_prefix: dict[str, Space] = {}
        self._spills: set[asyncio.Task] = set()
        self.pin_names = PinNames(timeouts.kv_store_pin_lease_s, clock)
        self.num_hits = self.num_misses = self.bytes_in = self.bytes_out = 0

    # ---- key spaces ----------------------------------------------------------------
    def has_space(self, model_id: str, layout: KVLayout, head_offset: int = 0) -> bool:
        return (model_id, space_key(layout, head_offset)) in self.spaces

    async def admit_space(self, model_id: str, layout: KVLayout, head_offset: int = 0) -> None:
        """Returns when the space exists or may be made: a live member serves model_id
        with this layout_key, and has a rank at head_offset. SpaceRefused otherwise;
        MembersUnavailable when the members cannot be listed; ValueError for a bad offset."""
        if self.members is None or self.has_space(model_id, layout, head_offset):
            return
        key = layout_key(layout)
        member = await self.members.find(lambda m: m.model_id == model_id and m.HasField("kv_layout")
                                         and layout_key(m.kv_layout) == key
                                         and head_offset in heads_offsets(m))
        if member is None:
            shown = model_id if len(model_id) <= 128 else model_id[:128] + "..."
            at = f" at head offset {head_offset}" if head_offset else ""
            raise SpaceRefused(f"space.model_id {shown!r} with layout {key}{at}: no live node of this mesh "
                               "serves it, and key spaces are made only for models that live nodes serve")

    def _space(self, model_id: str, layout: KVLayout, create: bool, head_offset: int = 0) -> Space | None:
        if not model_id:
            raise ValueError("space.model_id must not be empty")
        key = (model_id, space_key(layout, head_offset))
        space = self.spaces.get(key)
        if space is not None or not create:
            return space
        # a tensor-parallel node's ranks make one space each: they count once
        families = {(sp.model_id, layout_key(sp.memory.layout)) for sp in self.spaces.values()}
        if (model_id, layout_key(layout)) not in families and len(families) >= self.cfg.max_spaces:
            raise SpacesExhausted(f"the store holds {len(families)} key spaces (kv_store.max_spaces); "
                                  f"{model_id} {key[1]} is not one of them")
        per_slot = layout.num_layers * layout.layer_block_bytes
        num_slots = int(self.cfg.capacity_mb * (1 << 20)) // per_slot
        if num_slots < 1:
            raise ValueError(f"kv_store.capacity_mb {self.cfg.capacity_mb} holds no block of {per_slot} bytes")
        prefix = f"s{len(self.spaces) + 1}-"
        t = self.timeouts
        index = SlotIndex(num_slots, self.cfg.high_watermark, self.cfg.low_watermark,
                          t.kv_store_reserve_lease_s, t.kv_store_pin_lease_s, self.clock,
                          id_prefix=prefix, cool_s=t.transfer_bound_s)
        space = Space(model_id, key[1], index, SlotMemory(layout, num_slots, self.transfer))
        self.spaces[key] = space
        self._by_id_prefix[prefix] = space
        log.info("key space %s %s: %d slots of %d bytes", model_id, key[1], num_slots, per_slot)
        return space

    def _space_of(self, lease_id: str) -> Space:
        space = self._by_id_prefix.get(lease_id.split("-", 1)[0] + "-")
        if space is None:
            raise KeyError(lease_id)
        return space

    @staticmethod
    def _check(hashes: Sequence[bytes], token_ids: Sequence[int] | None, block_size: int) -> None:
        if len(hashes) > MAX_BLOCKS_PER_CALL:
            raise ValueError(f"block_hashes has {len(hashes)} entries; at most {MAX_BLOCKS_PER_CALL}")
        bad = [i for i, h in enumerate(hashes) if len(h) != DIGEST_SIZE]
        if bad:
            raise ValueError(f"block_hashes[{bad[0]}] has {len(hashes[bad[0]])} bytes; "
                             f"every hash has {DIGEST_SIZE} (common.hashing)")
        if token_ids is not None and len(token_ids) != len(hashes) * block_size:
            raise ValueError(f"token_ids has {len(token_ids)} ids; {len(hashes)} blocks of "
                             f"{block_size} need {len(hashes) * block_size}")

    @staticmethod
    def _blocks(token_ids: Sequence[int], block_size: int) -> list[tuple[int, ...]]:
        return [tuple(token_ids[i:i + block_size]) for i in range(0, len(token_ids), block_size)]

    def _redis_keys(self, space: Space, hashes: Sequence[bytes]) -> list[str]:
        return [self.redis.key(space.model_id, space.key, h) for h in hashes]

    # ---- operations ------------------------------------------------------------------
    async def lookup(self, model_id: str, layout: KVLayout, hashes: Sequence[bytes],
                     head_offset: int = 0) -> tuple[int, int]:
        """(leading hits in memory or Redis, leading hits in memory)."""
        self._check(hashes, None, layout.block_size)
        space = self._space(model_id, layout, create=False, head_offset=head_offset)
        in_memory = space.index.lookup(hashes) if space is not None else 0
        total = in_memory
        if self.redis is not None and space is not None and in_memory < len(hashes):
            for found in await self.redis.exists(self._redis_keys(space, hashes[in_memory:])):
                if not found:
                    break
                total += 1
        return total, in_memory

    def reserve_put(self, model_id: str, layout: KVLayout, hashes: Sequence[bytes],
                    token_ids: Sequence[int], head_offset: int = 0) -> tuple[str, list[int], list[int], Space]:
        """(put_id, indices into hashes, slots, space) for the blocks not held yet."""
        self._check(hashes, token_ids, layout.block_size)
        space = self._space(model_id, layout, create=True, head_offset=head_offset)
        put_id, placed, evicted = space.index.reserve(hashes, self._blocks(token_ids, layout.block_size))
        self._spill(space, evicted)
        return put_id, [i for i, _ in placed], [s for _, s in placed], space

    def commit_put(self, put_id: str) -> int:
        """KeyError when unknown or expired."""
        space = self._space_of(put_id)
        committed = space.index.commit(put_id)
        self.bytes_in += len(committed) * space.memory.bytes_per_slot
        return len(committed)

    async def pin_get(self, model_id: str, layout: KVLayout, hashes: Sequence[bytes],
                      token_ids: Sequence[int], head_offset: int = 0, name: str = ""
                      ) -> tuple[str, list[int], int, Space | None]:
        """(pin id or "", slots of the leading hits, how many were promoted from Redis,
        space). name: the caller's id for the pin (pin_names.py), answered as its id;
        ValueError when malformed or naming a pin already; a name already released
        (overtaken) pins nothing."""
        self._check(hashes, token_ids, layout.block_size)
        if name:
            check_name(name)
            if name in self.pin_names:
                raise ValueError(f"pin_id {name!r} names a pin already; name each PinGet anew")
            if self.pin_names.was_overtaken(name):
                return "", [], 0, None     # its caller has given it up and released it
        space = self._space(model_id, layout, create=self.redis is not None, head_offset=head_offset)
        if space is None:
            self.num_misses += len(hashes)
            return "", [], 0, None
        tokens = self._blocks(token_ids, layout.block_size)
        pin_id, slots = space.index.pin(hashes, tokens)
        promoting = self.redis is not None and len(slots) < len(hashes)
        if promoting:
            pin_id = pin_id or space.index.new_pin()
        if name and pin_id:
            self.pin_names.bind(name, space, pin_id)   # before the await: Release(name) may come meanwhile
        promoted = 0
        if promoting:
            promoted = await self._promote(space, pin_id, hashes[len(slots):], tokens[len(slots):], slots)
        if pin_id and pin_id not in space.index.pins:
            slots = []                     # released by name, or lapsed, while Redis answered
        if not slots and pin_id:
            space.index.release(pin_id)
            if name:
                self.pin_names.unbind(name)
            pin_id = ""
        self.num_hits += len(slots)
        self.num_misses += len(hashes) - len(slots)
        self.bytes_out += len(slots) * space.memory.bytes_per_slot
        return (name or pin_id) if pin_id else "", slots, promoted, space

    async def _promote(self, space: Space, pin_id: str, hashes: Sequence[bytes],
                       tokens: Sequence[tuple[int, ...]], slots: list[int]) -> int:
        """Bring the leading Redis hits into slots, pinned under pin_id; appends to slots."""
        values = await self.redis.get_many(self._redis_keys(space, hashes))
        if pin_id not in space.index.pins:
            return 0  # expired while Redis answered
        promoted = 0
        for h, want, value in zip(hashes, tokens, values):
            entry = space.index.entries.get(h)
            if entry is not None:  # a put committed it meanwhile, or it is being written
                if not entry.committed or entry.token_ids != want:
                    break
            else:
                block = decode_block(value, space.model_id, space.key, want) if value else None
                if block is None:
                    break
                entry, evicted = space.index.insert_committed(h, want)
                self._spill(space, evicted)
                if entry is None:
                    break
                space.memory.write_slot(entry.slot, block[1])
                promoted += 1
            space.index.add_to_pin(pin_id, h)
            slots.append(entry.slot)
        self.redis.num_promoted += promoted
        return promoted

    def release(self, pin_id: str, slots: Sequence[int] = (), generations: Sequence[int] = ()) -> bool:
        """End the pin (if it has not lapsed). With slots and their generations (what
        pin_get answered): True when every slot still holds that block (reads of it were
        its bytes), whether or not the pin lapsed (a caller-named pin: up to one more lease
        after it lapsed). Without: True if the pin was live. A caller's name that names no
        pin is remembered: its PinGet may still be on its way (pin_names.py)."""
        bound = self.pin_names.unbind(pin_id)
        if bound is not None:
            space, pin_id = bound
        else:
            try:
                space = self._space_of(pin_id)
            except KeyError:
                if NAME.fullmatch(pin_id):
                    self.pin_names.overtaken(pin_id)
                return False
        live = space.index.release(pin_id)
        return space.index.unchanged(slots, generations) if slots else live

    def generations(self, space: Space, slots: Sequence[int]) -> list[int]:
        return [space.index.generations[s] for s in slots]

    def expire(self) -> None:
        for space in self.spaces.values():
            puts, pins = space.index.expire()
            if puts:
                log.info("%s: %d uncommitted put(s) expired", space.model_id, puts)
            if pins:
                log.info("%s: %d pin(s) ended by their lease: never released by their reader", space.model_id, pins)
        self.pin_names.expire(lambda space, pin_id: pin_id in space.index.pins)

    # ---- Redis spill -----------------------------------------------------------------
    def _spill(self, space: Space, evicted: list[Entry]) -> None:
        if not evicted or self.redis is None:
            return
        items = [(self.redis.key(space.model_id, space.key, e.block_hash),
                  encode_block(space.model_id, space.key, e.token_ids, space.memory.read_slot(e.slot)))
                 for e in evicted]
        task = asyncio.get_running_loop().create_task(self.redis.spill(items))
        self._spills.add(task)
        task.add_done_callback(self._spills.discard)

    async def flush(self) -> None:
        """Wait for the spills in flight (tests, shutdown)."""
        while self._spills:
            await asyncio.wait(list(self._spills))

    # ---- introspection -----------------------------------------------------------------
    def stats(self) -> dict[str, int | bool | str]:
        idx = [s.index for s in self.spaces.values()]
        r = self.redis
        return {
            "blocks_used": sum(i.num_used for i in idx), "blocks_total": sum(i.num_slots for i in idx),
            "blocks_pinned": sum(i.num_pinned for i in idx), "hits": self.num_hits,
            "misses": self.num_misses, "evictions": sum(i.num_evictions for i in idx),
            "bytes_in": self.bytes_in, "bytes_out": self.bytes_out,
            "expired_reservations": sum(i.num_expired_reservations for i in idx),
            "expired_pins": sum(i.num_expired_pins for i in idx),
            "num_spaces": len(self.spaces), "redis_configured": r is not None,
            "redis_up": bool(r and r.up), "redis_spilled": r.num_spilled if r else 0,
            "redis_promoted": r.num_promoted if r else 0, "redis_errors": r.num_errors if r else 0,
            "redis_last_error": r.last_error if r else "",
        }

    async def close(self) -> None:
        await self.flush()
        if self.redis is not None:
            await self.redis.close()
        if self.members is not None:
            await self.members.close()
