"""A request inside the engine.

Lifecycle: WAITING -> RUNNING (prefill chunks, then one token a step) -> FINISHED_*.
A decode node's disaggregated request goes WAITING -> REMOTE_PREFILL (blocks allocated,
a prefill node writes them) -> RUNNING with its first token, or back to local prefill.
Preemption moves RUNNING back to WAITING with its blocks freed; it is then recomputed as
a prompt of prompt + generated tokens (prefix-cache hits make that cheap).

Token bookkeeping: `token_ids` holds prompt + output. `num_computed_tokens` of them have
their KV in the cache; the rest are computed by upcoming steps.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Callable

import torch

from common.engine.sampling_params import SamplingParams


class SequenceStatus(IntEnum):
    WAITING = 0
    REMOTE_PREFILL = 1
    RUNNING = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def finished(self) -> bool:
        return self >= SequenceStatus.FINISHED_STOPPED


FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
}


@dataclass(eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    arrival: int
    num_prompt_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1          # prefix-cache hit at first admission; -1 = not yet
    num_preemptions: int = 0
    generator: torch.Generator | None = None
    logprobs: list[dict[int, float]] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.perf_counter)
    first_scheduled_time: float | None = None
    remote_prefill: bool = False         # admit into REMOTE_PREFILL instead of computing
    hold_blocks: bool = False            # keep blocks after finishing until released
    on_computed: Callable[["Sequence", int, int], None] | None = None  # (seq, start, end)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = self.num_prompt_tokens or len(self.token_ids)
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_prefilling(self) -> bool:
        """True while more than the last token still needs computing."""
        return self.num_computed_tokens < len(self.token_ids) - 1

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)
