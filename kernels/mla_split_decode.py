"""MLA's absorbed decode over a split latent cache, in torch (any device): the path of a
backend whose cache has two planes (Backend.latent_planes() == 2) when its own kernel cannot
take the step (kernels/npu_mla.py: FIA's MLA mode wants a power of 2 of query heads).

    scores[s, h, t] = scale * (q_nope[s, h] . c_kv[t] + q_pe[s, h] . k_pe[t]),  t < seq_len[s]
    out[s, h]       = softmax_t(scores) . c_kv

Sequences go a few at a time (TILE_BYTES of context each) so the gathered context stays bounded.
"""
from __future__ import annotations

import torch

TILE_BYTES = 32 << 20    # float32 c_kv gathered at once


def split_latent_decode(query: torch.Tensor, nope: torch.Tensor, rope: torch.Tensor, meta, scale: float) -> torch.Tensor:
    """query [num_seqs, heads, R + P]; nope [NB, BS, 1, R], rope [NB, BS, 1, P]; meta a
    DecodeMetadata. Returns [num_seqs, heads, R] in query's dtype."""
    seqs, heads, width = query.shape
    rank = nope.shape[-1]
    if seqs == 0:
        return query.new_empty(0, heads, rank)
    block_size = nope.shape[1]
    max_blocks = -(-meta.max_seq_len // block_size)
    tokens = max_blocks * block_size
    rows = max(1, TILE_BYTES // (tokens * rank * 4))
    out = []
    for s0 in range(0, seqs, rows):
        tables = meta.block_tables[s0:s0 + rows, :max_blocks].long()
        n = tables.shape[0]
        c_kv = nope[tables].reshape(n, tokens, rank).float()
        k_pe = rope[tables].reshape(n, tokens, width - rank).float()
        q = query[s0:s0 + rows].float() * scale
        scores = torch.einsum("shr,str->sht", q[..., :rank], c_kv) + torch.einsum("shp,stp->sht", q[..., rank:], k_pe)
        visible = torch.arange(tokens, device=query.device)[None, :] < meta.seq_lens[s0:s0 + rows, None]
        scores.masked_fill_(~visible[:, None, :], float("-inf"))
        out.append(torch.einsum("sht,str->shr", scores.softmax(-1), c_kv))
    return torch.cat(out).to(query.dtype)
