"""Shared pieces of the kv-store tests: a client-side KV cache on the fake transfer engine
and the store-side calls a node makes (reserve -> write -> commit, pin -> compare)."""
from __future__ import annotations

import time

import torch

from common.config import KVStoreConfig, TimeoutConfig
from common.hashing import hash_block_chain, layout_key
from common.transfer.fake import FakeTransfer
from common.transfer.kv_writes import KVSender
from common.kv_layout import KVLayout
from common.runner.split_latent_cache import SplitLatentCache
from services.kv_store.store import KVStore

BLOCK_SIZE = 4


class ClientCache:
    """A node's KV cache [L, 2, num_blocks, BLOCK_SIZE, heads, head_dim] (latent: MLA's
    [L, 1, num_blocks, BLOCK_SIZE, 1, head_dim]; split_rope > 0: a SplitLatentCache of c_kv
    head_dim and k_pe split_rope wide), random contents, registered with its own fake
    transfer engine."""

    def __init__(self, num_blocks: int = 16, num_layers: int = 2, heads: int = 2, head_dim: int = 8,
                 dtype=torch.float32, block_size: int = BLOCK_SIZE, seed: int = 0, latent: bool = False,
                 split_rope: int = 0):
        gen = torch.Generator().manual_seed(seed)
        if split_rope:
            self.kv = SplitLatentCache(num_layers, num_blocks, block_size, head_dim, split_rope, dtype,
                                       torch.device("cpu"))
            self.kv.buffer.copy_(torch.randn(self.kv.buffer.shape, generator=gen))
        else:
            planes, heads = (1, 1) if latent else (2, heads)
            self.kv = torch.randn(num_layers, planes, num_blocks, block_size, heads, head_dim,
                                  generator=gen).to(dtype)
        self.transfer = FakeTransfer()
        self.transfer.register(self.kv.data_ptr(), self.kv.numel() * self.kv.element_size())
        self.layout = KVLayout.of_cache(self.kv)
        self.sender = KVSender(self.transfer, self.layout)

    def block_bytes(self, block_id: int) -> bytes:
        """The block's bytes in (layer, plane) order."""
        if isinstance(self.kv, SplitLatentCache):
            rows = [p[l, block_id].reshape(-1) for l in range(self.layout.num_layers) for p in (self.kv.nope, self.kv.rope)]
            return torch.cat(rows).view(torch.uint8).numpy().tobytes()
        return self.kv[:, :, block_id].contiguous().view(torch.uint8).numpy().tobytes()

    def close(self) -> None:
        self.transfer.close()


def chain(tokens: list[int], model_id: str, layout: KVLayout) -> list[bytes]:
    return hash_block_chain(tokens, layout.block_size, model_id, layout_key(layout))


def new_store(num_slots: int, cache: ClientCache, redis=None, clock=time.monotonic,
              timeouts: TimeoutConfig = TimeoutConfig(), transfer=None, **cfg) -> KVStore:
    per_slot = cache.layout.num_layers * cache.layout.layer_block_bytes
    config = KVStoreConfig(capacity_mb=num_slots * per_slot / (1 << 20), **cfg)
    return KVStore(config, transfer or FakeTransfer(), redis, clock, timeouts)


def put_blocks(store: KVStore, cache: ClientCache, model_id: str, tokens: list[int],
               block_ids: list[int]) -> list[int]:
    """What a prefill node does after a request: returns the slots written."""
    hashes = chain(tokens, model_id, cache.layout)
    put_id, indices, slots, space = store.reserve_put(model_id, cache.layout, hashes, tokens)
    if put_id:
        cache.sender.send_blocks(store.transfer.endpoint, space.memory.layout,
                                 [block_ids[i] for i in indices], slots)
        store.commit_put(put_id)
    return slots
