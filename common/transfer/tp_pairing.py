"""Which prefill node can push its KV into which decode node, across tensor-parallel sizes.

A node at TP n splits the model's KV heads over its n ranks: rank i holds the contiguous
head range [i * h, (i + 1) * h) of h = num_kv_heads / n heads (or, when n exceeds the
model's KV heads, every head group is replicated over n / num_kv_heads ranks). A prefill
node at TP p pushes into a decode node at TP d when
    p == d and both ranks hold as many heads (rank i writes rank i), or
    p == k * d (k > 1) and each prefill rank holds distinct heads, k of them making one
      decode rank's (prefill rank i writes its heads into decode rank i // k, at head
      offset (i % k) * h_p): what vLLM-Ascend serves.
An MLA model's latent cache (KVLayout kind "latent" or "latent_split") has no heads to split: every rank
of a node holds the same cache, so any p pushes into any d: decode rank j gets its copy,
whole blocks, from prefill rank j % p (the copies spread over the prefill ranks; a prefill
rank past d writes nothing).
Anything else (p < d: a prefill rank would have to split its heads over decode ranks;
replicated prefill heads at p > d; head counts that do not line up) is refused when the
route is chosen (services/meta_server/router.py), with the reason below, never
attempted; the prefill node checks the pair again before it writes
(services/prefill/kv_destination.py).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankWrite:
    """Prefill rank `src` writes its heads into decode rank `dst` from head `head_offset`."""

    src: int
    dst: int
    head_offset: int


def pairing_refusal(p: int, heads_p: int, d: int, heads_d: int, latent: bool = False) -> str | None:
    """None when a prefill node at TP p (heads_p KV heads per rank) can push into a
    decode node at TP d (heads_d per rank); else why not, in words for an operator.
    latent: both caches are MLA's (always served)."""
    p, d = max(p, 1), max(d, 1)
    if latent:
        return None
    if p < d:
        return (f"prefill TP {p} < decode TP {d}: a prefill rank would split its KV heads over decode "
                f"ranks (served: prefill TP = decode TP, or a multiple of it)")
    if p % d:
        return f"prefill TP {p} is not a multiple of decode TP {d}"
    k = p // d
    if heads_p * k != heads_d:
        why = "replicated KV heads" if heads_p * k > heads_d else "head counts that do not add up"
        return (f"prefill TP {p} ({heads_p} KV heads per rank) into decode TP {d} ({heads_d} per rank): "
                f"{why}")
    return None


def rank_writes(p: int, heads_p: int, d: int, heads_d: int, latent: bool = False) -> list[RankWrite]:
    """Which prefill rank writes which decode rank (ValueError when not served)."""
    refusal = pairing_refusal(p, heads_p, d, heads_d, latent)
    if refusal is not None:
        raise ValueError(refusal)
    p, d = max(p, 1), max(d, 1)
    if latent:
        return [RankWrite(j % p, j, 0) for j in range(d)]
    k = p // d
    return [RankWrite(i, i // k, (i % k) * heads_p) for i in range(p)]
