"""One step's model inputs as plain ints: what rank 0 plans (common/engine/step_runner.py)
and every rank's ModelRunner builds its tensors from (tables padded with block 0)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepInputs:
    """What ModelRunner builds a step's tensors from; the same on every rank."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    decode_lens: list[int] = field(default_factory=list)
    decode_tables: list[list[int]] = field(default_factory=list)    # padded rows
    query_lens: list[int] = field(default_factory=list)
    kv_lens: list[int] = field(default_factory=list)
    prefill_tables: list[list[int]] = field(default_factory=list)   # padded rows
    sample_rows: list[int] = field(default_factory=list)
    score_rows: list[int] = field(default_factory=list)     # rows of prompt positions to score
