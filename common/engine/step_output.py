"""What one engine step gives back per request (LLMEngine.step, AsyncEngine's streams)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepOutput:
    """New tokens of one request from one step."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    new_logprobs: list[dict[int, float]] | None = None
    queue_s: float = 0.0                 # arrival to first admission
    # on the first output of a request with prompt_logprobs: one entry per prompt position,
    # None at 0, then {actual token: logprob, top tokens...}
    prompt_logprobs: list[dict[int, float] | None] | None = None
