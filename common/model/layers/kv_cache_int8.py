"""The static scales of one attention layer's int8 KV cache (msModelSlim's "C8"): per
channel (kv_heads * head_dim) for keys and for values, read from the checkpoint as

    <prefix>k_proj.kv_cache_scale  [kv_heads * head_dim]    <prefix>k_proj.kv_cache_offset  (same)
    <prefix>v_proj.kv_cache_scale                           <prefix>v_proj.kv_cache_offset

A tensor-parallel rank reads its KV heads' channels. The store and read rules, and how
attention runs over the codes, are kernels/kv_int8.py's. Checked after loading: every scale
finite and > 0, every offset a finite whole number in [-128, 127] (else the codes would
not mean what the scales say); a violation is a ValueError naming the tensor.
"""
from __future__ import annotations

import torch
from torch import nn

from common.model.layers.weight_slots import Slot, new_param, rows_slot
from kernels.kv_int8 import KVCacheScales, quantize_kv

NAMES = {"k_scale": "k_proj.kv_cache_scale", "k_offset": "k_proj.kv_cache_offset",
         "v_scale": "v_proj.kv_cache_scale", "v_offset": "v_proj.kv_cache_offset"}


class KVCacheInt8(nn.Module):
    def __init__(self, num_kv_heads: int, head_dim: int, full_kv: int, kv_start: int, prefix: str):
        super().__init__()
        self.shape, self.full_kv, self.kv_start, self.prefix = (num_kv_heads, head_dim), full_kv, kv_start, prefix
        size = num_kv_heads * head_dim
        for attr in NAMES:
            setattr(self, attr, new_param(size, dtype=torch.float32))
        self.scales: KVCacheScales | None = None

    def weight_slots(self, prefix: str) -> dict[str, Slot]:
        return {prefix + name: rows_slot(getattr(self, attr), 0, getattr(self, attr).shape[0], self.full_kv,
                                         self.kv_start)
                for attr, name in NAMES.items()}

    def prepare(self) -> None:
        """After loading and moving: check the values, build the backend's view."""
        for attr, name in NAMES.items():
            t = getattr(self, attr).detach()
            bad = ~torch.isfinite(t)
            if attr.endswith("scale"):
                bad |= t <= 0
                rule = "finite and > 0"
            else:
                bad |= (t != t.round()) | (t < -128) | (t > 127)
                rule = "a whole number in [-128, 127]"
            if bool(bad.any()):
                i = int(bad.nonzero()[0, 0]) + self.kv_start
                raise ValueError(f"{self.prefix}{name}: channel {i} holds {float(t.flatten()[i - self.kv_start])}; "
                                 f"each value must be {rule}")
        self.scales = KVCacheScales(*(getattr(self, attr).detach().view(self.shape) for attr in NAMES))

    def quantize(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """key, value [tokens, kv_heads, head_dim] -> their int8 codes."""
        s = self.scales
        return quantize_kv(key, s.k_scale, s.k_offset), quantize_kv(value, s.v_scale, s.v_offset)
