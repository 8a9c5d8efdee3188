"""Grouped-query attention (MHA when the KV heads equal the query heads) over the paged
KV cache.

    x -> qkv (column-parallel: this rank's query and KV heads) -> [q/k RMSNorm per head]
      -> rotary -> [C8: k, v to int8 codes] -> write k, v into the cache at the step's slots
      -> decode tokens: paged decode; prefill chunks: causal over cached prefix + chunk
      -> o (row-parallel: all-reduce, then its bias)

Decode and prefill tokens of one step are packed [decodes | prefill chunks]
(common/model/step_batch.py); each half goes to its kernel.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from common.model.config import ModelConfig
from common.model.layers.kv_cache_int8 import KVCacheInt8
from common.model.layers.linear import Linear, LinearPart
from common.model.layers.norm import RMSNorm
from common.model.layers.quant_config import QuantizationConfig
from common.model.layers.weight_slots import Slot
from common.model.step_batch import StepBatch
from common.parallel.shard import TPShard

if TYPE_CHECKING:
    from kernels import Backend


class GQAAttention(nn.Module):
    """prefix: the checkpoint's name of this module, e.g. "model.layers.3.self_attn." (the
    quantization config is asked by it)."""

    def __init__(self, cfg: ModelConfig, shard: TPShard, quant: QuantizationConfig, prefix: str,
                 dtype: torch.dtype):
        super().__init__()
        hd = self.head_dim = cfg.head_dim
        self.num_heads, self.num_kv_heads = shard.num_heads, shard.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * hd, self.num_kv_heads * hd
        full_q, full_kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
        q0, kv0 = shard.head_start * hd, shard.kv_head_start * hd
        parts = [LinearPart("q_proj", full_q, self.q_size, q0),
                 LinearPart("k_proj", full_kv, self.kv_size, kv0),
                 LinearPart("v_proj", full_kv, self.kv_size, kv0)]
        self.qkv = Linear(parts, cfg.hidden_size, quant.linear_method([prefix + p.name for p in parts]),
                          dtype, bias=cfg.qkv_bias, prefix=prefix)
        o_part = [LinearPart("o_proj", cfg.hidden_size, cfg.hidden_size)]
        self.o = Linear(o_part, full_q, quant.linear_method([prefix + "o_proj"]), dtype, bias=cfg.o_bias,
                        row_parallel=True, in_features=self.q_size, in_start=q0, prefix=prefix)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.scale = hd ** -0.5
        self.kv_int8 = KVCacheInt8(self.num_kv_heads, hd, full_kv, kv0, prefix) if quant.kv_cache_int8 else None

    def weight_slots(self, prefix: str) -> dict[str, Slot]:
        slots = {**self.qkv.weight_slots(prefix), **self.o.weight_slots(prefix)}
        if self.q_norm is not None:
            slots.update(self.q_norm.weight_slots(prefix + "q_norm"))
            slots.update(self.k_norm.weight_slots(prefix + "k_norm"))
        if self.kv_int8 is not None:
            slots.update(self.kv_int8.weight_slots(prefix))
        return slots

    def forward(self, x: torch.Tensor, batch: StepBatch, cache: torch.Tensor,
                backend: Backend, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """cache: this layer's [2, num_blocks, block_size, num_kv_heads, head_dim] (keys, values)."""
        n, hd = x.shape[0], self.head_dim
        k_cache, v_cache = cache[0], cache[1]
        q, k, v = self.qkv(x, backend).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, hd)
        k = k.view(n, self.num_kv_heads, hd)
        v = v.reshape(n, self.num_kv_heads, hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q, backend), self.k_norm(k, backend)
        q, k = backend.rotary(batch.positions, q, k, cos, sin)
        kv_scales = None
        if self.kv_int8 is not None:     # C8: the cache holds codes, and attention reads codes
            k, v = self.kv_int8.quantize(k, v)
            kv_scales = self.kv_int8.scales
        backend.write_kv(k, v, k_cache, v_cache, batch.slot_mapping)
        nd = batch.num_decode_tokens
        if batch.prefill is None:
            out = backend.decode(q, k_cache, v_cache, batch.decode, self.scale, kv_scales)
        elif batch.decode is None:
            out = backend.prefill(q, k, v, k_cache, v_cache, batch.prefill, self.scale, kv_scales)
        else:
            out = torch.cat([
                backend.decode(q[:nd], k_cache, v_cache, batch.decode, self.scale, kv_scales),
                backend.prefill(q[nd:], k[nd:], v[nd:], k_cache, v_cache, batch.prefill, self.scale, kv_scales),
            ])
        return self.o(out.reshape(n, self.q_size), backend)
