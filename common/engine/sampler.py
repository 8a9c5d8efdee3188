"""Token sampling for one step: greedy, temperature, top-k, top-p, per-request seeds.

Random rows use the exponential race (argmax of probs / Exp(1) noise). The noise of a
seeded request at output position p comes from a generator seeded with
position_seed(seed, p): a function of (seed, p) only, not of what ran before. So a seeded
request draws the same noise alone, batched, after a preemption (recomputed), or resumed
at position p on another node (migrated): same seed -> same tokens. Unseeded rows share
the engine's generator.
"""
from __future__ import annotations

import torch

from common.engine.sequence import Sequence


_MASK64 = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """A 64-bit seed for (seed, output position): splitmix64 of the pair, so that
    neighbouring positions and seeds get unrelated streams."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) what top_k (per row, vocab = off) and top_p (per row) exclude."""
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device).expand_as(sorted_logits)
    drop = ranks >= top_k.unsqueeze(1)
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    cum_before = probs.cumsum(dim=-1) - probs
    drop |= cum_before >= top_p.unsqueeze(1)
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)


def sample(logits: torch.Tensor, seqs: list[Sequence], generator: torch.Generator) -> list[int]:
    """One token per row of logits [num_seqs, vocab] (float32); row i belongs to seqs[i]."""
    greedy_rows = [i for i, s in enumerate(seqs) if s.params.greedy]
    if len(greedy_rows) == len(seqs):
        return logits.argmax(dim=-1).tolist()
    tokens = logits.argmax(dim=-1)
    rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
    params = [seqs[i].params for i in rows]
    sub = logits[rows]
    temps = torch.tensor([p.temperature for p in params], dtype=sub.dtype, device=sub.device)
    sub = sub / temps.unsqueeze(1)
    vocab = sub.shape[-1]
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=sub.device)
        top_p = torch.tensor([p.top_p for p in params], dtype=sub.dtype, device=sub.device)
        sub = _apply_top_k_top_p(sub, top_k, top_p)
    probs = sub.softmax(dim=-1)
    noise = torch.empty(probs.shape, dtype=probs.dtype)   # on the CPU, where the generators are
    for j, i in enumerate(rows):
        seq = seqs[i]
        if seq.params.seed is None:
            noise[j].exponential_(generator=generator)
        else:
            own = torch.Generator().manual_seed(position_seed(seq.params.seed, seq.output_position))
            noise[j].exponential_(generator=own)
    tokens[rows] = (probs / noise.to(probs.device)).argmax(dim=-1)
    return tokens.tolist()


def compute_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: list[int | None]
                     ) -> list[dict[int, float] | None]:
    """Log-probabilities of the model's distribution: the sampled token plus the top-n,
    for rows whose num_top is not None."""
    rows = [i for i, n in enumerate(num_top) if n is not None]
    out: list[dict[int, float] | None] = [None] * len(token_ids)
    if not rows:
        return out
    logp = logits[rows].log_softmax(dim=-1)
    for j, i in enumerate(rows):
        entry = {token_ids[i]: float(logp[j, token_ids[i]])}
        if num_top[i]:
            values, ids = logp[j].topk(num_top[i])
            entry.update(zip(ids.tolist(), values.tolist()))
        out[i] = entry
    return out
