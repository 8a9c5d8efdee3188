"""MLA's latent KV cache as two planes a layer: c_kv rows and k_pe rows, each contiguous.

    buffer [num_layers, num_blocks * block_size * (kv_lora_rank + rope)]   one allocation
    layer i:  nope = buffer[i, :NB*BS*R]  viewed [num_blocks, block_size, 1, kv_lora_rank]
              rope = buffer[i, NB*BS*R:]  viewed [num_blocks, block_size, 1, rope]

The one-plane latent cache (a [L, 1, NB, BS, 1, R + rope] tensor, one row a token) is what
the CPU and CUDA decode kernels read; torch_npu's MLA attention (FIA's MLA mode) takes the
c_kv and k_pe caches only as two separate contiguous tensors, so a backend that wants them
(Backend.latent_planes() == 2) gets this. `cache[i]` is layer i's (nope, rope): the model
passes a layer's planes to the backend as a tuple either way (layers/mla.py). Peers see the
layout as KVLayout kind "latent_split": per layer, plane 0 then plane 1, each block of a
plane one span.
"""
from __future__ import annotations

import torch

from common.kv_layout import KVLayout


class SplitLatentCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_lora_rank: int, rope_dim: int,
                 dtype: torch.dtype, device: torch.device):
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.kv_lora_rank, self.rope_dim = kv_lora_rank, rope_dim
        nope = num_blocks * block_size * kv_lora_rank
        self.buffer = torch.zeros(num_layers, nope + num_blocks * block_size * rope_dim, dtype=dtype, device=device)
        self.nope = self.buffer[:, :nope].view(num_layers, num_blocks, block_size, 1, kv_lora_rank)
        self.rope = self.buffer[:, nope:].view(num_layers, num_blocks, block_size, 1, rope_dim)

    def __getitem__(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(layer, int):      # not a tensor: kv_cache[:, :, ids] means nothing here
            raise TypeError(f"a split latent cache is indexed by layer only, got {layer!r}")
        return self.nope[layer], self.rope[layer]

    def __len__(self) -> int:
        return self.num_layers

    @property
    def device(self) -> torch.device:
        return self.buffer.device

    @property
    def dtype(self) -> torch.dtype:
        return self.buffer.dtype

    def data_ptr(self) -> int:
        return self.buffer.data_ptr()

    def numel(self) -> int:
        return self.buffer.numel()

    def element_size(self) -> int:
        return self.buffer.element_size()

    def kv_layout(self) -> KVLayout:
        item = self.buffer.element_size()
        return KVLayout(dtype=str(self.dtype).removeprefix("torch."), num_layers=self.num_layers,
                        num_blocks=self.num_blocks, block_size=self.block_size, num_kv_heads=1,
                        head_dim=self.kv_lora_rank, base_address=self.buffer.data_ptr(),
                        strides=(self.buffer.stride(0) * item, self.nope[0].numel() * item,
                                 *(s * item for s in self.nope.stride()[1:])),
                        kind="latent_split", rope_dim=self.rope_dim)
