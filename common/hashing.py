"""Block hash chain shared by every service (gateway, meta-server, prefill, decode, kv-store).

    h_i = blake2b(h_{i-1} || token_ids of block i || model_id || layout)

over full blocks only. Token ids are packed as little-endian int32, so the hash is the
same on every host and never depends on PYTHONHASHSEED. `h_{-1}` is the empty string.
"""
from __future__ import annotations

import functools
import hashlib
from array import array
from collections.abc import Sequence
import sys

DIGEST_SIZE = 16
_ITEMSIZE = array("i").itemsize


def _pack(token_ids: Sequence[int]) -> bytes:
    packed = array("i", token_ids)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def layout_key(layout) -> str:
    """The layout part of every block hash: what two KV caches must share for a block to
    be valid in both. `layout` is anything with dtype, num_layers, num_kv_heads, head_dim,
    block_size, scales_id, kind and rope_dim (common.kv_layout.KVLayout or its proto). A
    latent (MLA) cache's key says so, and how its rows are split: its rows are not a head's K
    and V, and a split latent's block bytes are laid out apart (kv-store blocks)."""
    key = (f"{layout.dtype}:L{layout.num_layers}:H{layout.num_kv_heads}"
           f":D{layout.head_dim}:B{layout.block_size}")
    if layout.kind == "latent":
        key += ":latent"
    elif layout.kind == "latent_split":
        key += f":latent_split:R{layout.rope_dim}"
    return f"{key}:{layout.scales_id}" if layout.scales_id else key


@functools.lru_cache(maxsize=256)
def _suffix(model_id: str, layout: str) -> bytes:
    return model_id.encode() + b"\x00" + layout.encode()


def block_hash(parent: bytes | None, token_ids: Sequence[int], model_id: str = "",
               layout: str = "") -> bytes:
    """Hash of one full block given the hash of the block before it (None for the first)."""
    h = hashlib.blake2b(parent or b"", digest_size=DIGEST_SIZE)
    h.update(_pack(token_ids))
    h.update(_suffix(model_id, layout))
    return h.digest()


def hash_block_chain(token_ids: Sequence[int], block_size: int, model_id: str = "",
                     layout: str = "", parent: bytes | None = None) -> list[bytes]:
    """Hashes of every full block of token_ids; a trailing partial block has none.
    (block_hash over each block; the ids are packed once.)"""
    packed, suffix, step = _pack(token_ids), _suffix(model_id, layout), _ITEMSIZE * block_size
    hashes: list[bytes] = []
    for start in range(0, (len(token_ids) // block_size) * step, step):
        h = hashlib.blake2b(parent or b"", digest_size=DIGEST_SIZE)
        h.update(packed[start:start + step])
        h.update(suffix)
        parent = h.digest()
        hashes.append(parent)
    return hashes
