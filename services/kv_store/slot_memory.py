"""The bytes of one key space's pool: host memory laid out like a KV cache whose blocks
are the store's slots, registered once with the transfer engine.

    pool [num_layers, sum over planes of num_slots * plane_block_bytes]   (uint8)
    layer l, plane p:  pool[l, offset_p : offset_p + num_slots * plane_block_bytes(p)]
                       viewed [num_slots, plane_block_bytes(p)]

(planes and their block bytes as in KVLayout: K and V, MLA's one latent plane, or a split
latent's c_kv and k_pe), so a client moves blocks with the same planner as prefill ->
decode pushes (common/transfer/kv_writes.py), runs of consecutive slots merging into one
range. A block's bytes outside the pool (Redis) are its planes x num_layers segments in
(layer, plane) order.

Not thread-safe; the memory stays alive (and registered) until close().
"""
from __future__ import annotations

import torch

from common.transfer.base import TransferEngine
from common.kv_layout import KVLayout


class SlotMemory:
    def __init__(self, space_layout: KVLayout, num_slots: int, transfer: TransferEngine):
        s = space_layout
        sizes = [s.plane_block_bytes(p) for p in range(s.planes)]
        self.pool = torch.zeros(s.num_layers, num_slots * sum(sizes), dtype=torch.uint8)
        offsets = [num_slots * sum(sizes[:p]) for p in range(s.planes)]
        self.planes = [self.pool[:, o:o + num_slots * n].view(s.num_layers, num_slots, n)
                       for o, n in zip(offsets, sizes)]
        item = s.itemsize
        strides = (self.pool.stride(0), offsets[1] if s.planes > 1 else 0, sizes[0],
                   s.num_kv_heads * s.head_dim * item, s.head_dim * item, item)
        self.layout = KVLayout(dtype=s.dtype, num_layers=s.num_layers, num_blocks=num_slots,
                               block_size=s.block_size, num_kv_heads=s.num_kv_heads,
                               head_dim=s.head_dim, base_address=self.pool.data_ptr(),
                               strides=strides, scales_id=s.scales_id, kind=s.kind, rope_dim=s.rope_dim)
        self.bytes_per_slot = s.num_layers * sum(sizes)
        self.transfer = transfer
        transfer.register(self.pool.data_ptr(), self.pool.numel())

    def read_slot(self, slot: int) -> bytes:
        """A copy of the slot's bytes (taken now: the slot may be reused right after)."""
        return torch.cat([plane[:, slot] for plane in self.planes], dim=1).numpy().tobytes()

    def write_slot(self, slot: int, data: bytes) -> None:
        if len(data) != self.bytes_per_slot:
            raise ValueError(f"slot data has {len(data)} bytes, the layout needs {self.bytes_per_slot}")
        src = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(len(self.planes[0]), -1)
        start = 0
        for plane in self.planes:
            plane[:, slot] = src[:, start:start + plane.shape[2]]
            start += plane.shape[2]
