"""KV that comes into a request's blocks from another node: the protocol AsyncEngine
drives (common/engine/async_engine.py) and what a fill reports.

Implementations: services/decode/remote_prefill.py (a prefill node writes the prompt's
KV and samples the first token) and services/prefill/store_prefix.py (the kv-store's
hits are read into the leading blocks).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class KVFilled:
    """What a RemoteKV put in the blocks: the KV of the first num_tokens prompt tokens,
    and the first token when a prefill node sampled it (then num_tokens is the prompt),
    with its logprobs when the request asked for them."""

    num_tokens: int
    first_token: int | None = None
    first_logprobs: dict[int, float] | None = None


class RemoteKV(Protocol):
    """One request's KV coming from another node into this node's blocks."""

    async def fill(self, block_ids: list[int], num_cached_tokens: int) -> KVFilled:
        """Fill the blocks past num_cached_tokens (the local prefix hit). Raise when it
        failed: the engine then computes the prompt here."""

    async def cancel(self) -> bool:
        """Stop filling. True once no write can land in the blocks any more; False when
        that could not be confirmed in time (then settled() says when)."""

    async def settled(self) -> None:
        """Return once no write can land any more (after cancel returned False)."""
