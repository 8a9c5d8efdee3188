"""Per-request sampling parameters, vLLM-compatible names.

`validate` raises ValueError naming the field and its allowed range; the engine calls it
before anything is scheduled.

logprobs: every generated token carries its log-probability and the top `logprobs`.
prompt_logprobs (vLLM's meaning): every prompt position after the first carries the
log-probability of the actual prompt token there and the top `prompt_logprobs` (the
model's distribution at the position before, no temperature); such a request's prompt is
computed in full (no prefix-cache hit, no remote prefill), so every position has logits.
"""
from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20   # top tokens per position a request may ask for (OpenAI's bound)


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self, vocab_size: int | None = None) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1 or self.top_k == 0:
            raise ValueError(f"top_k must be -1 (disabled) or an integer >= 1, got {self.top_k!r}")
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < 2**64):
            raise ValueError(f"seed must be an integer in [0, 2**64), got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is None:
                continue
            if not (isinstance(value, int) and 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {value!r}")
            if vocab_size is not None and value >= vocab_size:
                raise ValueError(f"{name} must be below the vocabulary size ({vocab_size}), got {value}")
        if vocab_size is not None:
            for i, t in enumerate(self.stop_token_ids):
                if not 0 <= t < vocab_size:
                    raise ValueError(f"stop_token_ids[{i}]={t} is outside the vocabulary [0, {vocab_size})")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
