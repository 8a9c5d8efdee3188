"""MLA's absorbed decode on the CPU as two GEMMs a sequence (the cpu backend's mla_decode,
for sequences whose blocks are consecutive in the cache).

Every query head of an MLA layer attends over the same latent rows (one KV "head"), so a
sequence's step is
    rows   = its latent rows [seq_len, R + P], read in place (its blocks consecutive)
    scores = (q [heads, R + P] x scale) @ rows^T        one GEMM for every head
    out    = softmax(scores) @ rows[:, :R]              one GEMM
where the per-head paged decode (kernels/csrc) reads every row once a head and dots it as
a vector. bench/mla_decode.py: 0.66x of the paged kernel's time at batch 16, context 1k
(DeepSeek-V2-Lite's layer); gathering scattered blocks first costs more than it gains at
short contexts and large batches (1.5x slower at 32 x 512), so those sequences stay on the
paged kernel (CpuBackend.mla_decode splits the batch).
"""
from __future__ import annotations

import torch


def consecutive(meta, block_size: int) -> list[bool]:
    """Per sequence: whether its blocks are consecutive ids (one contiguous span of rows)."""
    out = []
    for s, seq_len in enumerate(meta.seq_lens_list):
        blocks = meta.block_tables[s, :-(-seq_len // block_size)]
        out.append(blocks.numel() == 1 or bool((blocks[1:] - blocks[:-1] == 1).all()))
    return out


def latent_gemm_decode(query: torch.Tensor, plane: torch.Tensor, meta, scale: float, rank: int) -> torch.Tensor:
    """query [num_seqs, heads, R + P]; plane [num_blocks, block_size, 1, R + P]; meta a
    DecodeMetadata whose sequences' blocks are consecutive (`consecutive`). Returns
    [num_seqs, heads, R] in query's dtype."""
    seqs, heads, width = query.shape
    out = torch.empty(seqs, heads, rank, dtype=torch.float32)
    block_size = plane.shape[1]
    rows_of = plane.view(-1, width)
    q = query.float() * scale
    for s, seq_len in enumerate(meta.seq_lens_list):
        first = int(meta.block_tables[s, 0]) * block_size
        rows = rows_of[first:first + seq_len].float()
        weights = torch.softmax(q[s] @ rows.T, dim=-1)
        torch.mm(weights, rows[:, :rank], out=out[s])
    return out.to(query.dtype)
