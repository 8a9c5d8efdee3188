"""A request inside the engine. Its lifecycle (`state`) is common/engine/lifecycle.py;
only the scheduler changes it.

Token bookkeeping: `token_ids` holds prompt + output. `num_computed_tokens` of them have
their KV in the cache; the rest are computed by upcoming steps. A resumed request (one
migrated from another node) has `resume_position` output tokens already at the end of
its prompt: its next token is sampled as output position resume_position +
num_output_tokens (the seeded sampler's position, common/engine/sampler.py).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from common.engine.lifecycle import RequestState
from common.engine.sampling_params import SamplingParams


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

    def __post_init__(self) -> None:
        self.num_prompt_tokens = self.num_prompt_tokens or len(self.token_ids)

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
    def is_prefilling(self) -> bool:
        """True while more than the last token still needs computing."""
        return self.num_computed_tokens < len(self.token_ids) - 1
