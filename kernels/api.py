"""The one kernel interface every compute service uses.

KV cache layout, everywhere:  k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
A token at position p of a sequence with block table bt lives in slot
    bt[p // block_size] * block_size + p % block_size
of the flat cache view [num_blocks * block_size, num_kv_heads, head_dim].

A model step packs its tokens as  [decode tokens (one per sequence) | prefill chunks],
so linear layers run once over every token; attention is split by the runner into one
`decode` call and one `prefill` call on the two parts.

Prefill is causal, bottom-right aligned: the query of a chunk holds the last
`q_len` tokens of a context of `seq_len` tokens (cached prefix + new tokens), so query
row i sees context positions [0, seq_len - q_len + i].

Linear layers go through the backend too: `prepare_linear` turns a loaded weight
[out_features, in_features] once into the form `linear` multiplies fastest (the default:
the weight itself, F.linear). A CPU's oneDNN wants its weights pre-packed, as an NPU's
matmul wants its own tile format; packing per call would cost more than the matmul.

Backends: `ref` (pure torch, kernels/ref.py), `cpu` (ref's attention on oneDNN-packed
linears, kernels/cpu.py), `npu` (torch_npu), `cuda` (flash-attn), chosen by
kernels.factory.get_backend.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kernels.kv_int8 import KVCacheScales
from kernels.mla_split_decode import split_latent_decode
from kernels.moe import routed_experts, sigmoid_grouped_top_k, softmax_top_k


@dataclass
class PrefillMetadata:
    """Prefill part of a step. Built once a step by the model runner, shared by all layers.

    query_start_loc: int32 [num_seqs + 1], cumulative query starts (0 first, num_tokens last).
    seq_lens:        int32 [num_seqs], context length per sequence (cached prefix + new).
    block_tables:    int32 [num_seqs, max_blocks], padded with 0 past each sequence's blocks.
    query_lens_list, seq_lens_list: the same on the host, for loops and for ops taking lists.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    query_lens_list: list[int]
    seq_lens_list: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens_list)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_list, default=0)


@dataclass
class DecodeMetadata:
    """Decode part of a step: one query token per sequence, at position seq_len - 1.

    seq_lens:     int32 [num_seqs], context length including the new token.
    block_tables: int32 [num_seqs, max_blocks], padded with 0.
    seq_lens_list: host copy of seq_lens.
    """

    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    seq_lens_list: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_list, default=0)


class Backend(ABC):
    """Paged attention and the small fused ops around it. Stateless apart from caches of
    constants (masks); safe to share across layers. Every method is called inside
    torch.inference_mode on tensors of one device."""

    name: str = "abstract"

    @abstractmethod
    def supported_block_sizes(self) -> list[int] | None:
        """Block sizes this backend accepts; None means any."""

    @abstractmethod
    def write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store key/value [num_tokens, num_kv_heads, head_dim] into the caches (mutated in
        place) at slot_mapping (int64 [num_tokens]); a slot of -1 is skipped."""

    def latent_planes(self, kv_lora_rank: int, rope_dim: int) -> int:
        """How this backend wants MLA's latent cache: 1, one plane of [c_kv | k_pe] rows
        [num_blocks, block_size, 1, kv_lora_rank + rope]; 2, c_kv [.., kv_lora_rank] and k_pe
        [.., rope] as two contiguous planes (common/runner/split_latent_cache.py). The MLA
        methods below take a layer's planes as a tuple of one or two."""
        return 1

    def write_latent(self, c_kv: torch.Tensor, k_pe: torch.Tensor, planes: tuple[torch.Tensor, ...],
                     slot_mapping: torch.Tensor) -> None:
        """MLA: store c_kv [num_tokens, kv_lora_rank] and k_pe [num_tokens, rope] into the
        latent cache's planes (in place) at slot_mapping; a slot of -1 is skipped."""
        valid = slot_mapping >= 0
        slots = slot_mapping[valid]
        if len(planes) == 1:
            rows = torch.cat([c_kv, k_pe], dim=-1)[valid].unsqueeze(1)
            planes[0].view(-1, *planes[0].shape[2:]).index_copy_(0, slots, rows.to(planes[0].dtype))
            return
        for plane, rows in zip(planes, (c_kv, k_pe)):
            plane.view(-1, *plane.shape[2:]).index_copy_(0, slots, rows[valid].unsqueeze(1).to(plane.dtype))

    def mla_latent(self, positions: torch.Tensor, q_pe: torch.Tensor, kv_a: torch.Tensor, norm_weight: torch.Tensor,
                   eps: float, cos: torch.Tensor, sin: torch.Tensor, planes: tuple[torch.Tensor, ...],
                   slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """MLA's step before attention (common/model/layers/mla.py): kv_a [num_tokens,
        kv_lora_rank + rope] is kv_a_proj_with_mqa's output, c_kv then k_pe, both rope parts
        (k_pe and q_pe [num_tokens, num_heads, rope]) already in rotate-half order. Returns
        (q_pe rotated, c_kv = rms_norm(kv_a[:, :kv_lora_rank], norm_weight, eps) [num_tokens,
        kv_lora_rank], k_pe rotated [num_tokens, rope]) and writes them into the latent
        cache's planes at slot_mapping as write_latent does (in place). Here: rms_norm,
        rotary, write_latent."""
        rank = norm_weight.shape[0]
        c_kv = self.rms_norm(kv_a[:, :rank].contiguous(), norm_weight, eps)
        q_pe, k_pe = self.rotary(positions, q_pe, kv_a[:, None, rank:].contiguous(), cos, sin)
        k_pe = k_pe.reshape(kv_a.shape[0], -1)
        self.write_latent(c_kv, k_pe, planes, slot_mapping)
        return q_pe, c_kv, k_pe

    def mla_decode(self, query: torch.Tensor, planes: tuple[torch.Tensor, ...], meta: DecodeMetadata, scale: float,
                   kv_lora_rank: int) -> torch.Tensor:
        """MLA's absorbed decode (common/model/layers/mla.py): query [num_seqs, num_heads,
        kv_lora_rank + rope] (q_nope through W_UK, then q_pe) over the latent cache as one KV
        head whose keys are the rows [c_kv | k_pe] and values their c_kv. Returns [num_seqs,
        num_heads, kv_lora_rank] in query's dtype. Here, one plane: the paged decode with the
        cache as both K and V (its rope columns' output dropped: rope / (kv_lora_rank + rope)
        more value work); two: torch's (kernels/mla_split_decode.py)."""
        if len(planes) == 2:
            return split_latent_decode(query, planes[0], planes[1], meta, scale)
        return self.decode(query, planes[0], planes[0], meta, scale)[..., :kv_lora_rank]

    @abstractmethod
    def prefill(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PrefillMetadata,
                scale: float, kv_scales: KVCacheScales | None = None) -> torch.Tensor:
        """Causal attention for packed prefill chunks.

        query [num_tokens, num_heads, head_dim]; key/value [num_tokens, num_kv_heads,
        head_dim] are the new tokens, already written to the caches by write_kv (a backend
        may use them directly where a sequence has no cached prefix). GQA: num_heads is a
        multiple of num_kv_heads. Softmax accumulates in float32. Returns
        [num_tokens, num_heads, head_dim] in query's dtype.

        kv_scales: the caches are int8 (C8, kernels/kv_int8.py) and key/value are the new
        tokens' int8 codes; attention is over the values the codes stand for."""

    @abstractmethod
    def decode(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: DecodeMetadata, scale: float, kv_scales: KVCacheScales | None = None) -> torch.Tensor:
        """Attention of one query token per sequence over its whole cached context.

        query [num_seqs, num_heads, head_dim]; returns the same shape and dtype.
        kv_scales: int8 caches, as for prefill."""

    def prepare_linear(self, weight: torch.Tensor) -> Any:
        """The form `linear` takes this weight [out_features, in_features] in. Called once
        per weight after loading; the caller drops its own reference when the result is
        not `weight` itself. Default: the weight unchanged."""
        return weight

    def linear(self, x: torch.Tensor, weight: Any, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., in_features] @ weight^T + bias, weight as prepare_linear returned it."""
        return F.linear(x, weight, bias)

    int8_path: str = "exact float64 matmul of the int8 codes (reference)"   # said at start-up

    def quantize_per_token(self, x: torch.Tensor, divisor: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Dynamic symmetric int8 of each row of x [rows, features]: scale = max|row| /
        divisor (127, or 127.5 by compressed-tensors' convention; 1 for an all-zero row),
        q = clamp(round(x / scale), -128, 127), rounding half to even, in float32.
        Returns (int8 [rows, features], float32 [rows, 1])."""
        xf = x.float()
        amax = xf.abs().amax(dim=-1, keepdim=True)
        scale = torch.where(amax > 0, amax / divisor, torch.ones_like(amax))
        return torch.round(xf / scale).clamp_(-128, 127).to(torch.int8), scale

    def quantize_per_tensor(self, x: torch.Tensor, scale: float, offset: float) -> torch.Tensor:
        """Static asymmetric int8 of x [rows, features] with one scale and offset (msModelSlim's
        W8A8): clamp(round(x / scale + offset), -128, 127), rounding half to even, in float32."""
        return torch.round(x.float() / scale + offset).clamp_(-128, 127).to(torch.int8)

    def prepare_int8_weight(self, weight: torch.Tensor) -> Any:
        """The form `int8_matmul` takes an int8 weight [out_features, in_features] in; the
        caller drops its own reference when the result is not `weight`. Default: as is."""
        return weight

    def int8_matmul(self, x_q: torch.Tensor, weight: Any) -> torch.Tensor:
        """int8 [rows, in] @ int8 weight^T (as prepare_int8_weight returned it) -> int32
        [rows, out], exact. Default: in float64, exact while in_features * 128^2 < 2^53."""
        return (x_q.double() @ weight.double().t()).to(torch.int32)

    def int8_scaled_matmul(self, x_q: torch.Tensor, weight: Any, scale: torch.Tensor,
                           row_scale: torch.Tensor | None = None, int_bias: torch.Tensor | None = None,
                           bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The W8A8 linear after its input was quantized (npu_quant_matmul's contract):

            out = ((x_q @ W^T + int_bias) * scale * row_scale + bias).to(out_dtype)

        x_q int8 [rows, in]; weight as prepare_int8_weight returned it; scale float32 [1, out]
        (per channel); row_scale float32 [rows, 1] (per token) or None; int_bias int32 [out]
        or None (added exactly, before scaling); bias float [out] or None (after)."""
        acc = self.int8_matmul(x_q, weight)
        if int_bias is not None:
            acc = acc + int_bias
        out = acc.float().mul_(scale)
        if row_scale is not None:
            out.mul_(row_scale)
        if bias is not None:
            out += bias.float()
        return out.to(out_dtype)

    int4_path: str = "weights dequantized once at load (reference)"   # said at start-up

    def prepare_int4_weight(self, codes: torch.Tensor, scale: torch.Tensor, group_size: int,
                            dtype: torch.dtype) -> Any:
        """The form `int4_linear` takes a group-quantized 4-bit weight in: codes int32 [out,
        in] holding q + 8 (0..15), scale float32 [out, in / group_size]; the weight is
        (codes - 8) * scale, group by group along the inputs. Default: that weight in
        dtype, dequantized once."""
        weight = (codes - 8).to(torch.float32) * scale.repeat_interleave(group_size, dim=1)
        return weight.to(dtype)

    def int4_linear(self, x: torch.Tensor, weight: Any, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., in] @ weight^T + bias, weight as prepare_int4_weight returned it."""
        return F.linear(x, weight, bias)

    @abstractmethod
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x * rsqrt(mean(x^2) + eps) * weight, computed in float32, returned in x's dtype."""

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """residual += x (in residual's dtype, in place: the caller owns it), then
        rms_norm(residual): the pre-norm between a layer's sublayers. x and residual
        [rows, features] alike."""
        residual.add_(x)
        return self.rms_norm(residual, weight, eps)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, 2 * width] holding [gate | up] -> silu(gate) * up [rows, width]."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def softmax_top_k(self, logits: torch.Tensor, top_k: int,
                      renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """A Mixture-of-Experts router's softmax top-k (kernels/moe.py has the contract):
        logits [tokens, experts] -> (weights float32, ids int64) [tokens, top_k]; the order of
        the k is the backend's own."""
        return softmax_top_k(logits, top_k, renormalize)

    def sigmoid_grouped_top_k(self, logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, n_group: int,
                              topk_group: int, renormalize: bool,
                              scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek-V3's router (kernels/moe.py has the contract): logits [tokens, experts],
        bias float32 [experts] or None -> (weights float32, ids int64) [tokens, top_k]."""
        return sigmoid_grouped_top_k(logits, bias, top_k, n_group, topk_group, renormalize, scaling)

    def prepare_experts(self, w13: torch.Tensor, w2: torch.Tensor) -> tuple[Any, Any]:
        """A MoE layer's float experts, w13 [num_local, 2 * inter, hidden] and w2 [num_local,
        hidden, inter], in the form `routed_experts` takes them (as prepare_linear does for a
        linear layer's weight); the caller drops its dense storage when the result is not
        them. Default: as is."""
        return w13, w2

    def routed_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
                       w2: torch.Tensor, first_expert: int = 0) -> torch.Tensor:
        """A Mixture-of-Experts layer's routed experts (kernels/moe.py has the contract):
        x [tokens, hidden], the router's weights float32 and ids int64 [tokens, top_k], this
        rank's experts w13 [num_local, 2 * inter, hidden] (gate rows, then up rows) and w2
        [num_local, hidden, inter] as prepare_experts returned them, the first of them
        first_expert -> this rank's share [tokens, hidden] in x's dtype."""
        return routed_experts(x, weights, ids, w13, w2, first_expert)

    @abstractmethod
    def rotary(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
               cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Neox-style (rotate-half) rotary embedding.

        positions int64 [num_tokens]; query [num_tokens, num_heads, head_dim];
        key [num_tokens, num_kv_heads, head_dim]; cos/sin [max_positions, head_dim // 2]
        tables (kernels.rope.rope_cos_sin). Returns the rotated (query, key); a backend
        may rotate the given tensors in place and return them."""
