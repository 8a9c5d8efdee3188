"""The bytes of one key space's pool: host memory laid out like a KV cache whose blocks
are the store's slots, registered once with the transfer engine.

    pool [num_layers, planes, num_slots, block_bytes]  (uint8; planes and block_bytes as in
                                                        KVLayout: K and V, or MLA's latent)

so a client moves blocks with the same planner as prefill -> decode pushes
(common/transfer/kv_writes.py), runs of consecutive slots merging into one range.
A block's bytes outside the pool (Redis) are its planes x num_layers segments in (layer,
plane) order.

Not thread-safe; the memory stays alive (and registered) until close().
"""
from __future__ import annotations

import torch

from common.transfer.base import TransferEngine
from common.kv_layout import KVLayout


class SlotMemory:
    def __init__(self, space_layout: KVLayout, num_slots: int, transfer: TransferEngine):
        s = space_layout
        self.block_bytes = s.block_bytes
        self.pool = torch.zeros(s.num_layers, s.planes, num_slots, self.block_bytes, dtype=torch.uint8)
        item = s.itemsize
        strides = tuple(x for x in self.pool.stride()[:3]) + (
            s.num_kv_heads * s.head_dim * item, s.head_dim * item, item)
        self.layout = KVLayout(dtype=s.dtype, num_layers=s.num_layers, num_blocks=num_slots,
                               block_size=s.block_size, num_kv_heads=s.num_kv_heads,
                               head_dim=s.head_dim, base_address=self.pool.data_ptr(),
                               strides=strides, scales_id=s.scales_id, kind=s.kind)
        self.transfer = transfer
        transfer.register(self.pool.data_ptr(), self.pool.numel())

    @property
    def bytes_per_slot(self) -> int:
        return self.pool.shape[0] * self.pool.shape[1] * self.block_bytes

    def read_slot(self, slot: int) -> bytes:
        """A copy of the slot's bytes (taken now: the slot may be reused right after)."""
        return self.pool[:, :, slot].contiguous().numpy().tobytes()

    def write_slot(self, slot: int, data: bytes) -> None:
        if len(data) != self.bytes_per_slot:
            raise ValueError(f"slot data has {len(data)} bytes, the layout needs {self.bytes_per_slot}")
        src = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.pool[:, :, slot] = src.view(self.pool.shape[0], self.pool.shape[1], self.block_bytes)
