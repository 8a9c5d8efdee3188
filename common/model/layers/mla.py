"""Multi-head latent attention (DeepSeek-V2/V3) over a paged latent cache.

    x -> [q_a_proj -> q_a_layernorm -> q_b_proj | q_proj]      this rank's query heads
      -> q = (q_nope [qk_nope_head_dim], q_pe [qk_rope_head_dim]) per head
    x -> kv_a_proj_with_mqa -> (c_kv [kv_lora_rank] -> kv_a_layernorm, k_pe [qk_rope_head_dim])
      -> rotary on q_pe and k_pe (DeepSeek's interleaved pairs first de-interleaved)
      -> write the latent [c_kv | k_pe] (one row, no heads) into the cache at the step's slots
         (norm, rotary and write: Backend.mla_latent, one fused op on the NPU)
      -> decode tokens: absorbed. q_nope through W_UK into the latent space, attention of
         [q_nope W_UK | q_pe] over the latent rows as one KV head (values: the rows' c_kv),
         then W_UV out of it: the paged decode kernel, never a per-head K/V
      -> prefill chunks: expanded. Cached prefix + chunk through kv_b_proj into per-head
         k_nope and v, k = [k_nope | k_pe], causal attention (bottom-right)
      -> o_proj (row-parallel: all-reduce, then its bias)

The latent cache is one plane [num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim] a
layer, or, where the backend wants them apart (Backend.latent_planes, the NPU's), two: c_kv
[.., kv_lora_rank] and k_pe [.., qk_rope_head_dim] (common/runner/split_latent_cache.py).
The backend's MLA methods take the layer's planes as a tuple either way. Under tensor parallelism the
query heads (q_b_proj / q_proj, kv_b_proj's rows, o_proj's columns) are split; the
down-projections, their norms and so the latent cache are whole on every rank.

Softmax scale: qk_head_dim ** -0.5, times mscale ** 2 under yarn with mscale_all_dim
(transformers' yarn_apply_mscale).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from common.model.config import ModelConfig
from common.model.layers.linear import Linear, LinearPart
from common.model.layers.norm import RMSNorm
from common.model.layers.quant_config import QuantizationConfig
from common.model.layers.weight_slots import Slot
from common.model.step_batch import StepBatch
from common.parallel.shard import TPShard
from kernels.rope import yarn_mscale

if TYPE_CHECKING:
    from kernels import Backend, PrefillMetadata


def mla_softmax_scale(cfg: ModelConfig) -> float:
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    rope = cfg.rope_scaling or {}
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        mscale = yarn_mscale(rope["factor"], rope["mscale_all_dim"])
        scale *= mscale * mscale
    return scale


class MLAAttention(nn.Module):
    """prefix: the checkpoint's name of this module, e.g. "model.layers.3.self_attn."."""

    def __init__(self, cfg: ModelConfig, shard: TPShard, quant: QuantizationConfig, prefix: str,
                 dtype: torch.dtype):
        super().__init__()
        self.num_heads, h0 = shard.num_heads, shard.head_start
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.rank, self.q_lora = cfg.kv_lora_rank, cfg.q_lora_rank
        self.interleaved = cfg.rope_interleave
        qk = self.nope + self.rope
        heads, latent = cfg.num_heads, self.rank + self.rope

        def linear(parts: list[LinearPart], full_in: int, bias: bool = False, **kw) -> Linear:
            return Linear(parts, full_in, quant.linear_method([prefix + p.name for p in parts]), dtype,
                          bias=bias, prefix=prefix, **kw)

        q_heads = LinearPart("q_b_proj" if self.q_lora else "q_proj", heads * qk, self.num_heads * qk, h0 * qk)
        kv_a = LinearPart("kv_a_proj_with_mqa", latent, latent)
        if self.q_lora:     # both down-projections read x: one matmul (whole on every rank)
            self.down = linear([LinearPart("q_a_proj", self.q_lora, self.q_lora), kv_a], cfg.hidden_size,
                               bias=cfg.o_bias)
            self.q_a_norm = RMSNorm(self.q_lora, cfg.rms_norm_eps, dtype)
            self.q_up = linear([q_heads], self.q_lora)
        else:
            self.down = linear([kv_a], cfg.hidden_size, bias=cfg.o_bias)
            self.q_a_norm = None
            self.q_up = linear([q_heads], cfg.hidden_size)
        self.kv_a_norm = RMSNorm(self.rank, cfg.rms_norm_eps, dtype)
        kv_b = self.nope + self.v_dim
        self.kv_b = linear([LinearPart("kv_b_proj", heads * kv_b, self.num_heads * kv_b, h0 * kv_b)], self.rank)
        if self.kv_b.method.scheme != "FLOAT":     # before a byte is read
            raise ValueError(f"{self.kv_b.projections[0]}: MLA's decode absorbs kv_b_proj into the query and "
                             f"output, so it must be FLOAT, got {self.kv_b.method.scheme}")
        self.o = linear([LinearPart("o_proj", cfg.hidden_size, cfg.hidden_size)], heads * self.v_dim,
                        bias=cfg.o_bias, row_parallel=True, in_features=self.num_heads * self.v_dim,
                        in_start=h0 * self.v_dim)
        self.scale = mla_softmax_scale(cfg)
        # the absorbed decode's per-head matrices, from kv_b_proj's weight (absorb())
        self.w_uk: torch.Tensor | None = None     # [heads, qk_nope_head_dim, kv_lora_rank]
        self.w_uv: torch.Tensor | None = None     # [heads, kv_lora_rank, v_head_dim]

    def weight_slots(self, prefix: str) -> dict[str, Slot]:
        slots = {**self.down.weight_slots(prefix), **self.q_up.weight_slots(prefix),
                 **self.kv_a_norm.weight_slots(prefix + "kv_a_layernorm"),
                 **self.kv_b.weight_slots(prefix), **self.o.weight_slots(prefix)}
        if self.q_a_norm is not None:
            slots.update(self.q_a_norm.weight_slots(prefix + "q_a_layernorm"))
        return slots

    def absorb(self) -> None:
        """After loading and moving to the device, before the linears are prepared (their
        dense weights may be packed away then): W_UK and W_UV from kv_b_proj. Its weight
        is float (refused otherwise when the layer is built)."""
        w = self.kv_b.weight.detach().view(self.num_heads, self.nope + self.v_dim, self.rank)
        self.w_uk = w[:, :self.nope].contiguous()
        self.w_uv = w[:, self.nope:].transpose(1, 2).contiguous()

    def forward(self, x: torch.Tensor, batch: StepBatch, cache, backend: Backend,
                cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """cache: this layer's [1, num_blocks, block_size, 1, kv_lora_rank + rope] (its one
        latent plane) or (c_kv plane, k_pe plane); tuple() makes either the planes' tuple."""
        n, h, planes = x.shape[0], self.num_heads, tuple(cache)
        down = self.down(x, backend)
        if self.q_a_norm is not None:
            q_a, kv_a = down.split([self.q_lora, self.rank + self.rope], dim=-1)
            q = self.q_up(self.q_a_norm(q_a.contiguous(), backend), backend)
        else:
            kv_a, q = down, self.q_up(x, backend)
        q = q.view(n, h, self.nope + self.rope)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        if self.interleaved:
            c_kv, k_pe = kv_a.split([self.rank, self.rope], dim=-1)
            kv_a = torch.cat([c_kv, self._deinterleave(k_pe)], dim=-1)
        q_pe, c_kv, k_pe = backend.mla_latent(batch.positions, self._deinterleave(q_pe), kv_a, self.kv_a_norm.weight,
                                              self.kv_a_norm.eps, cos, sin, planes, batch.slot_mapping)
        nd = batch.num_decode_tokens
        parts = []
        if batch.decode is not None:
            parts.append(self._decode(q_nope[:nd], q_pe[:nd], planes, batch, backend))
        if batch.prefill is not None:
            latent = torch.cat([c_kv[nd:], k_pe[nd:]], dim=-1)
            parts.append(self._prefill(q_nope[nd:], q_pe[nd:], latent, planes, batch.prefill, backend))
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return self.o(out.reshape(n, h * self.v_dim), backend)

    def _deinterleave(self, x: torch.Tensor) -> torch.Tensor:
        """Pairs (x0, x1), (x2, x3), ... -> (x0, x2, ..) | (x1, x3, ..): the halves the
        rotate-half rotary turns. q and k get the same permutation, so q.k is unchanged."""
        if not self.interleaved:
            return x.contiguous()
        return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)

    def _decode(self, q_nope, q_pe, planes, batch: StepBatch, backend: Backend) -> torch.Tensor:
        q_latent = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)      # [n, heads, rank]
        query = torch.cat([q_latent, q_pe], dim=-1)
        out = backend.mla_decode(query, planes, batch.decode, self.scale, self.rank)   # [n, heads, rank]
        return torch.bmm(out.transpose(0, 1), self.w_uv).transpose(0, 1)            # [n, heads, v_dim]

    def _prefill(self, q_nope, q_pe, latent, planes, meta: PrefillMetadata, backend: Backend) -> torch.Tensor:
        """Per sequence: its context's latents (the chunk's own when there is no cached
        prefix, else read back from the cache's planes) expanded into per-head K and V."""
        block_size = planes[0].shape[1]
        query = torch.cat([q_nope, q_pe], dim=-1)
        out = query.new_empty(query.shape[0], self.num_heads, self.v_dim)
        start = 0
        for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list)):
            end = start + q_len
            if q_len == 0:
                continue
            if q_len == seq_len:
                context, mask = latent[start:end], None
            else:
                blocks = meta.block_tables[i, :-(-seq_len // block_size)]
                context = torch.cat([p.index_select(0, blocks).view(-1, p.shape[-1]) for p in planes], dim=-1)[:seq_len]
                mask = torch.ones(q_len, seq_len, dtype=torch.bool, device=query.device).tril(seq_len - q_len)
            kv = self.kv_b(context[:, :self.rank].contiguous(), backend)
            kv = kv.view(seq_len, self.num_heads, self.nope + self.v_dim)
            k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
            k_pe = context[:, None, self.rank:].expand(seq_len, self.num_heads, self.rope)
            k = torch.cat([k_nope, k_pe], dim=-1)
            o = F.scaled_dot_product_attention(query[start:end].transpose(0, 1), k.transpose(0, 1),
                                               v.transpose(0, 1), attn_mask=mask, is_causal=mask is None,
                                               scale=self.scale)
            out[start:end] = o.transpose(0, 1)
            start = end
        return out
