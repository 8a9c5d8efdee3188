"""A request inside the engine. Its lifecycle (`state`) is common/engine/lifecycle.py;
only the scheduler changes it.

Token bookkeeping: `token_ids` holds prompt + output. `num_computed_tokens` of them have
their KV in the cache; the rest are computed by upcoming steps. A resumed request (one
migrated from another node) has `resume_position` output tokens already at the end of
its prompt: its next token is sampled as output position resume_position +
num_output_tokens (the seeded sampler's position, common/engine/sampler.py).

Prompt logits (`wants_prompt_logits`: params.prompt_logprobs set, or a `prompt_sink`):
until its first token is emitted, every step that computes prompt positions p (all but
the last prompt token) hands their log-softmax rows to the engine, which fills
`prompt_logprobs[p + 1]` and calls `prompt_sink(p, rows)`; the prefix cache gives such a
sequence no hit (common/engine/block_manager.py), so every position is computed here. A
recompute after a preemption before the first token writes the same positions again
(overwrites by position; a sink must too); after the first token nothing is recorded.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from common.engine.lifecycle import RequestState
from common.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch


@dataclass(eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    arrival: int
    num_prompt_tokens: int = 0
    state: RequestState = RequestState.WAITING
    finish_reason: str | None = None     # stop | length | abort, once done
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1          # prefix-cache hit at first admission; -1 = not yet
    num_preemptions: int = 0
    resume_position: int = 0             # output tokens the prompt already ends with
    logprobs: list[dict[int, float]] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.perf_counter)
    first_scheduled_time: float | None = None
    kv_remote: bool = False              # the next admission waits in KV_REMOTE for its KV
    hold_blocks: bool = False            # finishing goes to HELD (blocks kept until released)
    on_computed: Callable[["Sequence", int, int], None] | None = None  # (seq, start, end)
    # (first position p, float32 log-softmax rows [k, vocab]: row j predicts token p + j + 1)
    prompt_sink: Callable[[int, "torch.Tensor"], None] | None = None
    # params.prompt_logprobs set: one entry per prompt position, None at 0 (filled as computed)
    prompt_logprobs: list[dict[int, float] | None] | None = None

    def __post_init__(self) -> None:
        self.num_prompt_tokens = self.num_prompt_tokens or len(self.token_ids)
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None] * self.num_prompt_tokens

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def output_position(self) -> int:
        """The output position of the token sampled next (counted from the original
        request's first output token)."""
        return self.resume_position + self.num_output_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def wants_prompt_logits(self) -> bool:
        """The prompt's positions need their logits (prompt_logprobs or a prompt_sink) and
        the first token is not out yet."""
        return ((self.params.prompt_logprobs is not None or self.prompt_sink is not None)
                and self.num_output_tokens == 0)

    @property
    def is_prefilling(self) -> bool:
        """True while more than the last token still needs computing."""
        return self.num_computed_tokens < len(self.token_ids) - 1
