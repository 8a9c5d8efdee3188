"""What services read of an AsyncEngine (never its scheduler or block manager directly):
its health, its counters, its model's shape. A mixin of AsyncEngine (common/engine/
async_engine.py), which holds `engine` (the LLMEngine), `_error`, `_busy_since` and
`_inbox`; every read here is lock-free and may be one step old.
"""
from __future__ import annotations

import time

from common.engine.sampling_params import SamplingParams


class EngineView:
    @property
    def error(self) -> BaseException | None:
        """Why the step loop died (None while it runs): no request can make progress."""
        return self._error

    def stalled_for_s(self) -> float:
        """How long the engine has owed progress: how long the step thread has held the
        engine in one go (draining commands, a step, delivering: a hung kernel, a deadlock),
        or the age of the oldest command still waiting in the inbox (a step thread that
        stopped draining it), whichever is longer; 0 when it owes none."""
        now = time.monotonic()
        started = self._busy_since
        owed = 0.0 if started is None else now - started
        try:   # no lock: whoever holds it may be the one that is stuck
            oldest = self._inbox[0]
        except IndexError:
            oldest = None
        queued_at = getattr(oldest, "queued_at", None)
        if queued_at is not None:
            owed = max(owed, now - queued_at)
        return owed

    def validate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """ValueError naming the field and its allowed range (nothing is queued)."""
        self.engine.validate_request(request_id, prompt_token_ids, params)

    def num_waiting(self) -> int:
        """Requests queued for admission now (a snapshot)."""
        return len(self.engine.scheduler.waiting)

    def snapshot(self) -> dict[str, int]:
        """The engine's counters now, without waiting for a step (reads counts only; may
        be one step old)."""
        return self.engine.stats()

    def expert_tokens(self) -> dict[int, list[int]]:
        """A MoE model's tokens per expert per layer since the engine started ({} for a
        dense model; LLMEngine.expert_tokens: lock-free, exact once no request runs)."""
        return self.engine.expert_tokens()

    @property
    def block_size(self) -> int:
        return self.engine.block_size

    def num_blocks_for(self, num_tokens: int) -> int:
        return self.engine.block_manager.num_blocks_for(num_tokens)

    @property
    def model_id(self) -> str:
        return self.engine.model_id

    @property
    def layout_key(self) -> str:
        return self.engine.layout

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len
