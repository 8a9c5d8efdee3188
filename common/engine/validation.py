"""Request validation shared by the engine and the gateway: ValueError naming the field
and its allowed range."""
from __future__ import annotations

from common.engine.sampling_params import SamplingParams


def validate_request(prompt_token_ids: list[int], params: SamplingParams, vocab_size: int,
                     max_model_len: int) -> None:
    if not prompt_token_ids:
        raise ValueError("prompt must not be empty (prompt_token_ids has 0 tokens)")
    for i, t in enumerate(prompt_token_ids):
        if not isinstance(t, int) or not 0 <= t < vocab_size:
            raise ValueError(f"prompt_token_ids[{i}]={t!r} is outside the vocabulary [0, {vocab_size})")
    params.validate(vocab_size)
    total = len(prompt_token_ids) + params.max_tokens
    if total > max_model_len:
        raise ValueError(f"prompt length ({len(prompt_token_ids)}) + max_tokens ({params.max_tokens}) "
                         f"= {total} must be <= max_model_len ({max_model_len})")


def validate_resume_position(resume_position: int, num_prompt_tokens: int) -> None:
    """A resumed request's prompt ends with resume_position output tokens: fewer than the
    prompt (at least one token of the original prompt is left)."""
    if not 0 <= resume_position < num_prompt_tokens:
        raise ValueError(f"resume_position must be in [0, {num_prompt_tokens}) (the prompt's length), "
                         f"got {resume_position}")
