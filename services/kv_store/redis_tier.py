"""The store's optional second tier: evicted blocks spill to Redis, a memory miss that
Redis holds is promoted back.

Key:   <prefix>:<model_id>:<layout key>:<block hash hex>
Value: b"PDKV1" | uint32 header length | JSON header | block bytes
       header = {"model_id", "layout", "token_ids", "nbytes"}: a value is used only when
       all of them match what the reader expects, so a block never crosses models,
       layouts or token contents, and a truncated value is a miss.

Redis down: every call returns "nothing" (a miss, a skipped spill) at once instead of
raising; the tier says so in the log (once per outage) and in `up` / `last_error`, and
tries to reconnect at most every `retry_s`. Short socket timeouts keep a hung Redis from
stalling the store.

Thread-safety: the store's event loop only.
"""
from __future__ import annotations

import json
import logging
import struct
import time
from collections.abc import Sequence

log = logging.getLogger("pdmesh.kv_store.redis")

MAGIC = b"PDKV1"


def encode_block(model_id: str, layout_key: str, token_ids: Sequence[int], data: bytes) -> bytes:
    header = json.dumps({"model_id": model_id, "layout": layout_key,
                         "token_ids": list(token_ids), "nbytes": len(data)}).encode()
    return b"".join((MAGIC, struct.pack("<I", len(header)), header, data))


def decode_block(value: bytes, model_id: str, layout_key: str,
                 token_ids: Sequence[int] | None) -> tuple[tuple[int, ...], bytes] | None:
    """(token ids, block bytes) when the value is intact and belongs to this model and
    layout (and holds token_ids, when given); None otherwise."""
    try:
        if value[:5] != MAGIC:
            return None
        (size,) = struct.unpack_from("<I", value, 5)
        header = json.loads(value[9:9 + size])
        data = value[9 + size:]
    except (struct.error, ValueError):
        return None
    tokens = tuple(header.get("token_ids", ()))
    if (header.get("model_id") != model_id or header.get("layout") != layout_key
            or header.get("nbytes") != len(data)
            or (token_ids is not None and tokens != tuple(token_ids))):
        return None
    return tokens, data


class RedisTier:
    def __init__(self, url: str, key_prefix: str = "pdmesh:kv", ttl_s: float = 0.0,
                 retry_s: float = 2.0, timeout_s: float = 1.0):
        import redis.asyncio as aioredis
        self.url, self.key_prefix, self.ttl_s, self.retry_s = url, key_prefix, ttl_s, retry_s
        self._client = aioredis.Redis.from_url(url, socket_timeout=timeout_s,
                                               socket_connect_timeout=timeout_s)
        self.up = True
        self.last_error = ""
        self.num_errors = self.num_spilled = self.num_promoted = 0
        self._down_since = 0.0

    def key(self, model_id: str, layout_key: str, block_hash: bytes) -> str:
        return f"{self.key_prefix}:{model_id}:{layout_key}:{block_hash.hex()}"

    def _available(self) -> bool:
        return self.up or time.monotonic() - self._down_since >= self.retry_s

    def _failed(self, what: str, exc: Exception) -> None:
        self.num_errors += 1
        self.last_error = f"{what}: {type(exc).__name__}: {exc}"
        if self.up:
            log.warning("Redis at %s unavailable (%s); serving from memory only until it is back",
                        self.url, self.last_error)
        self.up = False
        self._down_since = time.monotonic()

    def _ok(self) -> None:
        if not self.up:
            log.warning("Redis at %s is back", self.url)
        self.up = True

    async def _pipelined(self, what: str, commands: Sequence[tuple[str, tuple]], default) -> list:
        """Run the (method, args) commands in one round trip; [default] * n when Redis is
        down or fails (then marked down)."""
        if not commands or not self._available():
            return [default] * len(commands)
        try:
            async with self._client.pipeline(transaction=False) as pipe:
                for method, args in commands:
                    getattr(pipe, method)(*args)
                results = await pipe.execute()
        except Exception as exc:  # redis.RedisError, OSError, timeouts: all mean "down"
            self._failed(what, exc)
            return [default] * len(commands)
        self._ok()
        return results

    async def spill(self, items: Sequence[tuple[str, bytes]]) -> int:
        """SET each (key, value); returns how many were written (0 when Redis is down)."""
        px = int(self.ttl_s * 1000) or None
        done = await self._pipelined("spill", [("set", (k, v, None, px)) for k, v in items], False)
        written = sum(1 for ok in done if ok)
        self.num_spilled += written
        return written

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is held; all False when Redis is down."""
        return [bool(n) for n in await self._pipelined("exists", [("exists", (k,)) for k in keys], 0)]

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """Each key's value (None when absent); all None when Redis is down."""
        return await self._pipelined("get", [("get", (k,)) for k in keys], None)

    async def close(self) -> None:
        try:
            await self._client.aclose()
        except Exception:  # closing a connection to a dead Redis
            pass
