"""Multi-head Latent Attention on the npu backend (kernels/npu.py calls these).

torch_npu's MLA ops were made for vLLM-Ascend's two planes, nope [NB, BS, 1, 512] and rope
[NB, BS, 1, 64], each contiguous, so for DeepSeek's sizes the backend asks for the split
latent cache (latent_planes() == 2; common/runner/split_latent_cache.py):

    write   npu_kv_rmsnorm_rope_cache into the two planes (it also takes strided caches,
            aclnnKvRmsNormRopeCacheV2's table: non-contiguous √ for kCacheRef / ckvCacheRef,
            so a one-plane cache is written through two views of it: no copy).
    decode  npu_fused_infer_attention_score's MLA mode (query_rope / key_rope) over the two
            planes (fia_mla_decode). It takes key, value and key_rope contiguous only
            ("不支持非连续Tensor"): views of one plane would be refused, hence the split.
            It also takes 1, 2, 4, .., 128 query heads only: other head counts a rank (a TP
            size that leaves, say, 48) decode in torch (kernels/mla_split_decode.py), said once.

Both ops take Atlas A2/A3's sizes only: kv_lora_rank 512, qk_rope_head_dim 64 (DeepSeek-V2/V3's).
Other sizes get the one-plane cache and torch's paths.
"""
from __future__ import annotations

import logging

import torch

from kernels.api import DecodeMetadata
from kernels.mla_split_decode import split_latent_decode
from kernels.ref import RefBackend

log = logging.getLogger("pdmesh.kernels")

RANK, ROPE = 512, 64
FIA_MLA_QUERY_HEADS = (1, 2, 4, 8, 16, 32, 64, 128)


def write_refusal(rank: int, rope: int) -> str | None:
    """Why npu_kv_rmsnorm_rope_cache cannot write this model's latent, or None."""
    if (rank, rope) != (RANK, ROPE):
        return (f"npu_kv_rmsnorm_rope_cache takes kv_lora_rank {RANK} and qk_rope_head_dim {ROPE} only, "
                f"this model has {rank} and {rope}")
    return None


def write_latent_fused(npu, kv_a: torch.Tensor, norm_weight: torch.Tensor, eps: float, cos: torch.Tensor,
                       sin: torch.Tensor, planes: tuple[torch.Tensor, ...], slot_mapping: torch.Tensor):
    """Backend.mla_latent's c_kv and k_pe through one npu_kv_rmsnorm_rope_cache ("PA_BNSD")
    into the cache's planes (nope, rope), or into two views of one [.., 576] plane.
    kv_a [n, 576] with its rope part in rotate-half order; cos / sin [n, 1, 64] (both halves);
    every slot valid. The op first de-interleaves its rope input's pairs (x0 x2 .. | x1 x3 ..),
    so the halves are put back into pairs while the [1, 1, n, 576] input is built; the n
    tokens go in as one sequence (batch 1), which meets the op's block_num >=
    ceil(seq_len / block_size) * batch_size whenever the slots are distinct."""
    n = kv_a.shape[0]
    kv = kv_a.new_empty(1, 1, n, RANK + ROPE)
    kv[0, 0, :, :RANK] = kv_a[:, :RANK]
    kv[0, 0, :, RANK:].view(n, ROPE // 2, 2).copy_(kv_a[:, RANK:].view(n, 2, ROPE // 2).transpose(1, 2))
    nope, rope = planes if len(planes) == 2 else (planes[0][..., :RANK], planes[0][..., RANK:])
    _, _, k_pe, c_kv = npu.npu_kv_rmsnorm_rope_cache(
        kv, norm_weight, cos.view(1, 1, n, ROPE), sin.view(1, 1, n, ROPE), slot_mapping.to(torch.int64),
        rope, nope, epsilon=float(eps), cache_mode="PA_BNSD", is_output_kv=True)
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


class NpuMLA:
    """NpuBackend's MLA methods (a mixin before Backend: its torch paths are Backend's).
    Needs the backend's _npu, _valid_rows, _mla_missing, _fia_mla (FIA takes query_rope /
    key_rope) and _told."""

    def _say_once(self, key: str, message: str) -> None:
        if key not in self._told:
            self._told.add(key)
            log.warning("npu kernel backend: %s", message)

    def _fia_mla_refusal(self, rank: int, rope: int) -> str | None:
        """Why FIA's MLA mode cannot decode this model's latent, or None."""
        if not self._fia_mla:
            return (f"torch_npu {getattr(self._npu, '__version__', '?')}'s npu_fused_infer_attention_score has no "
                    "MLA mode (query_rope / key_rope)")
        if (rank, rope) != (RANK, ROPE):
            return f"FIA's MLA mode takes kv_lora_rank {RANK} and qk_rope_head_dim {ROPE} only"
        return None

    def latent_planes(self, kv_lora_rank: int, rope_dim: int) -> int:
        """Two (c_kv, k_pe) where FIA's MLA mode decodes them; one otherwise."""
        return 2 if self._fia_mla_refusal(kv_lora_rank, rope_dim) is None else 1

    def mla_latent(self, positions, q_pe, kv_a, norm_weight, eps: float, cos, sin, planes, slot_mapping):
        """q_pe through npu_rotary_mul; c_kv's norm, k_pe's rope and the cache write through one
        npu_kv_rmsnorm_rope_cache (write_latent_fused). torch's path where this torch_npu
        lacks the op or the model lacks its sizes (said once), and for a step holding a slot
        of -1 (the engine makes none)."""
        rank = norm_weight.shape[0]
        refusal = write_refusal(rank, kv_a.shape[1] - rank)
        if self._mla_missing:
            refusal = f"torch_npu {getattr(self._npu, '__version__', '?')} lacks {self._mla_missing}"
        if refusal is not None:
            self._say_once(refusal, f"{refusal}; MLA's latent norm, rope and cache write run torch's ops")
        if refusal is not None or kv_a.shape[0] == 0 or self._valid_rows(slot_mapping) is not None:
            return super().mla_latent(positions, q_pe, kv_a, norm_weight, eps, cos, sin, planes, slot_mapping)
        c, s = cos_sin(positions, cos, sin, q_pe.dtype)
        q_pe = self._npu.npu_rotary_mul(q_pe.contiguous(), c, s)
        c_kv, k_pe = write_latent_fused(self._npu, kv_a, norm_weight, eps, c, s, planes, slot_mapping)
        return q_pe, c_kv, k_pe

    def mla_decode(self, query, planes, meta: DecodeMetadata, scale: float, kv_lora_rank: int) -> torch.Tensor:
        """FIA's MLA mode over the two planes (fia_mla_decode); torch's decode where the
        rank's query heads are not a power of 2 up to 128 (said once), or over one plane (a
        model without DeepSeek's sizes: latent_planes() gave it one)."""
        heads = query.shape[1]
        if len(planes) == 2 and heads in FIA_MLA_QUERY_HEADS:
            return fia_mla_decode(self._npu, self._scale_kw, query, planes[0], planes[1], meta, scale)
        if len(planes) == 2:
            self._say_once("mla_heads", f"FIA's MLA mode takes {list(FIA_MLA_QUERY_HEADS)} query heads, this rank "
                                        f"has {heads}: MLA's absorbed decode runs torch's")
            return split_latent_decode(query, planes[0], planes[1], meta, scale)
        width = query.shape[-1]
        why = self._fia_mla_refusal(kv_lora_rank, width - kv_lora_rank) or "a one-plane latent cache"
        self._say_once("mla_one_plane", f"MLA's absorbed decode runs torch's paged decode: {why}")
        return RefBackend.decode(self, query, planes[0], planes[0], meta, scale)[..., :kv_lora_rank]


def cos_sin(positions, cos, sin, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [max_pos, D/2] -> the positions' [T, 1, D] (both halves) in dtype."""
    c = cos.index_select(0, positions)
    s = sin.index_select(0, positions)
    return (torch.cat((c, c), dim=-1).unsqueeze(1).to(dtype), torch.cat((s, s), dim=-1).unsqueeze(1).to(dtype))
