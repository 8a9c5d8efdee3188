"""Perplexity of a token sequence over sliding windows (services/eval/windows.py):
exp(mean negative log-likelihood) of every token but the first, each scored exactly once.

    result = perplexity(token_ids, window=512, stride=256, scorer=EngineScorer(llm))
    result.ppl, result.nll, result.scored, result.num_windows

The sum runs in float64 over the float32 logprobs the engine returns, in token order.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from services.eval.windows import Window, sliding_windows

WINDOWS_PER_CALL = 32   # windows handed to the scorer at once (it batches them itself)


@dataclass(frozen=True)
class Perplexity:
    ppl: float
    nll: float           # mean over the scored tokens (nats)
    scored: int
    num_windows: int
    window: int
    stride: int


def perplexity(token_ids: list[int], window: int, stride: int, scorer) -> Perplexity:
    """Score token_ids with scorer (EngineScorer / GatewayScorer) over the windows of
    sliding_windows. ValueError naming window or stride (see there), or window when the
    scorer's max_window is smaller."""
    if window > scorer.max_window:
        raise ValueError(f"window must be <= {scorer.max_window} (the model's max_model_len - 1), got {window}")
    windows = sliding_windows(len(token_ids), window, stride)
    total, scored = 0.0, 0
    for at in range(0, len(windows), WINDOWS_PER_CALL):
        part = windows[at:at + WINDOWS_PER_CALL]
        rows = scorer.score([token_ids[w.begin:w.end] for w in part])
        for w, row in zip(part, rows):
            for logp in scored_logprobs(w, row):
                total -= logp
                scored += 1
    nll = total / scored
    return Perplexity(math.exp(nll), nll, scored, len(windows), window, stride)


def scored_logprobs(w: Window, row: list[float]) -> list[float]:
    """Of a window's row (logp of tokens begin+1 .. end-1), those of its scored targets
    [first_scored, end)."""
    return row[w.first_scored - w.begin - 1:]
