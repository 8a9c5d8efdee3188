"""Request validation shared by the engine and the gateway: ValueError naming the field
and its allowed range."""
from __future__ import annotations

import math

from common.engine.sampling_params import SamplingParams


def validate_request(prompt_token_ids: list[int], params: SamplingParams, vocab_size: int,
                     max_model_len: int) -> None:
    """The whole request; the length first, so that a prompt far too long costs no pass
    over its ids."""
    validate_sampling(params, vocab_size)
    validate_length(len(prompt_token_ids), params, max_model_len)
    for i, t in enumerate(prompt_token_ids):
        if not isinstance(t, int) or not 0 <= t < vocab_size:
            raise ValueError(f"prompt_token_ids[{i}]={t!r} is outside the vocabulary [0, {vocab_size})")


def validate_sampling(params: SamplingParams, vocab_size: int | None = None) -> None:
    """SamplingParams.validate, and temperature and top_p finite (float32 on the wire:
    1e39 arrives as inf)."""
    for name in ("temperature", "top_p"):
        value = getattr(params, name)
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value!r}")
    params.validate(vocab_size)


def validate_length(num_prompt_tokens: int, params: SamplingParams, max_model_len: int) -> None:
    if num_prompt_tokens == 0:
        raise ValueError("prompt must not be empty (prompt_token_ids has 0 tokens)")
    total = num_prompt_tokens + params.max_tokens
    if total > max_model_len:
        raise ValueError(f"prompt length ({num_prompt_tokens}) + max_tokens ({params.max_tokens}) "
                         f"= {total} must be <= max_model_len ({max_model_len})")


def validate_resume_position(resume_position: int, num_prompt_tokens: int) -> None:
    """A resumed request's prompt ends with resume_position output tokens: fewer than the
    prompt (at least one token of the original prompt is left)."""
    if not 0 <= resume_position < num_prompt_tokens:
        raise ValueError(f"resume_position must be in [0, {num_prompt_tokens}) (the prompt's length), "
                         f"got {resume_position}")
