"""Results of the offline API, shaped like vLLM's so its users feel at home."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict[int, float]] | None = None
    stop_reason: str | int | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0
    finished: bool = True
    # SamplingParams.prompt_logprobs set: None at position 0, then per prompt position
    # {actual token: logprob, top tokens...} (vLLM's shape)
    prompt_logprobs: list[dict[int, float] | None] | None = None
