"""Multi-head Latent Attention on the npu backend (kernels/npu.py calls these).

The latent cache is one plane a layer, [num_blocks, block_size, 1, kv_lora_rank + rope]:
each row c_kv then k_pe (kernels/api.py). torch_npu's MLA ops were made for vLLM-Ascend's
two planes, nope [NB, BS, 1, 512] and rope [NB, BS, 1, 64], each contiguous:

    write   npu_kv_rmsnorm_rope_cache takes strided caches (its kernel's parameter table,
            aclnnKvRmsNormRopeCacheV2: non-contiguous √ for kCacheRef / ckvCacheRef), so it
            writes the plane through two views, ckv_cache = plane[..., :512] and
            k_cache = plane[..., 512:] (row stride 576): no copy.
    decode  npu_fused_infer_attention_score's MLA mode (query_rope / key_rope) takes key,
            value and key_rope contiguous only ("不支持非连续Tensor"); views of the plane are
            refused and a copy of the whole cache each step is out of the question, so the
            backend's decode stays on torch's paged decode (kernels/ref.py) until the cache
            is split into two planes. fia_mla_decode is the call for that layout, checked
            against the emulator, not used by the backend yet.

Both ops take Atlas A2/A3's sizes only: kv_lora_rank 512, qk_rope_head_dim 64 (DeepSeek-V2/V3's).
"""
from __future__ import annotations

import torch

from kernels.api import DecodeMetadata

RANK, ROPE = 512, 64


def write_refusal(rank: int, rope: int) -> str | None:
    """Why npu_kv_rmsnorm_rope_cache cannot write this model's latent, or None."""
    if (rank, rope) != (RANK, ROPE):
        return (f"npu_kv_rmsnorm_rope_cache takes kv_lora_rank {RANK} and qk_rope_head_dim {ROPE} only, "
                f"this model has {rank} and {rope}")
    return None


def write_latent_fused(npu, kv_a: torch.Tensor, norm_weight: torch.Tensor, eps: float, cos: torch.Tensor,
                       sin: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor):
    """Backend.mla_latent's c_kv and k_pe through one npu_kv_rmsnorm_rope_cache ("PA_BNSD").
    kv_a [n, 576] with its rope part in rotate-half order; cos / sin [n, 1, 64] (both halves);
    every slot valid. The op first de-interleaves its rope input's pairs (x0 x2 .. | x1 x3 ..),
    so the halves are put back into pairs while the [1, 1, n, 576] input is built; the n
    tokens go in as one sequence (batch 1), which meets the op's block_num >=
    ceil(seq_len / block_size) * batch_size whenever the slots are distinct."""
    n = kv_a.shape[0]
    kv = kv_a.new_empty(1, 1, n, RANK + ROPE)
    kv[0, 0, :, :RANK] = kv_a[:, :RANK]
    kv[0, 0, :, RANK:].view(n, ROPE // 2, 2).copy_(kv_a[:, RANK:].view(n, 2, ROPE // 2).transpose(1, 2))
    _, _, k_pe, c_kv = npu.npu_kv_rmsnorm_rope_cache(
        kv, norm_weight, cos.view(1, 1, n, ROPE), sin.view(1, 1, n, ROPE), slot_mapping.to(torch.int64),
        cache[..., RANK:], cache[..., :RANK], epsilon=float(eps), cache_mode="PA_BNSD", is_output_kv=True)
    return c_kv.view(n, RANK), k_pe.view(n, ROPE)


def fia_mla_decode(npu, scale_keyword: str, query: torch.Tensor, nope_cache: torch.Tensor, rope_cache: torch.Tensor,
                   meta: DecodeMetadata, scale: float) -> torch.Tensor:
    """Backend.mla_decode over a two-plane cache, vLLM-Ascend's call (BNSD, S = 1, sparse_mode
    0): query [num_seqs, heads, 576] (heads a power of 2 <= 128), nope_cache [NB, BS, 1, 512]
    and rope_cache [NB, BS, 1, 64], each contiguous. Returns [num_seqs, heads, 512]."""
    seqs, heads = query.shape[:2]
    num_blocks, block_size = nope_cache.shape[:2]
    out, _ = npu.npu_fused_infer_attention_score(
        query[..., :RANK].reshape(seqs, heads, 1, RANK).contiguous(),
        nope_cache.view(num_blocks, 1, block_size, RANK), nope_cache.view(num_blocks, 1, block_size, RANK),
        query_rope=query[..., RANK:].reshape(seqs, heads, 1, ROPE).contiguous(),
        key_rope=rope_cache.view(num_blocks, 1, block_size, ROPE),
        num_heads=heads, num_key_value_heads=1, input_layout="BNSD", block_table=meta.block_tables.to(
            torch.int32).contiguous(), block_size=block_size, actual_seq_lengths_kv=list(meta.seq_lens_list),
        sparse_mode=0, inner_precise=0, **{scale_keyword: float(scale)})
    return out.view(seqs, heads, RANK)
