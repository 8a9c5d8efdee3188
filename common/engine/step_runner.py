"""Runs one scheduled step on rank 0: plans it into StepInputs (plain ints), runs the
forward pass (through the tensor-parallel executor when there is one), and hands out
what the step computed.

A prefill chunk samples only when it reaches the end of its sequence's tokens.

Score rows (a sequence that wants its prompt's logits: Sequence.wants_prompt_logits): the
prompt positions of its chunk but the last prompt token, whose logits predict the next
prompt token:

    chunk of s: positions [begin, end) at packed rows r .. r + (end - begin) - 1
    scored:     positions [begin, min(end, num_prompt_tokens - 1))   (row of p: r + p - begin)
    position p's row predicts token p + 1

Their logits are computed after the sample rows, SCORE_SLICE_ROWS rows at a time (a
2048-token chunk never holds [2048, vocab] at once), and each slice goes, cut at
sequence boundaries, to `on_prompt_logits(seq, first position, float32 logits [k, vocab])`
before the next slice is computed.

Layer hooks: a prefill sequence whose `on_computed` has an `on_layer` attribute gets
`on_computed.on_layer(seq, layer, start, end)` on the step thread inside the forward pass,
right after layer `layer` wrote the KV of its chunk's tokens [start, end) (in layer order,
every layer, before the step's `on_computed(seq, start, end)`); on a device the runner
first waits for the kernels queued so far, so the callee may read those bytes at once.

At tensor parallelism the executor sends the StepInputs to the other ranks, and each
rank's ModelRunner (common/runner/) runs `forward` on its shard; layer hooks run on rank 0
only; the score rows travel in the StepInputs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from common.engine.scheduler import SchedulerOutput
from common.engine.sequence import Sequence
from common.runner.model_runner import ModelRunner
from common.runner.step_inputs import StepInputs


@dataclass(frozen=True)
class ScoreSpan:
    """Consecutive score rows of one sequence: positions [start, start + num_rows), at
    offset `offset` of the step's score rows."""

    seq: Sequence
    start: int
    num_rows: int
    offset: int


def _padded(tables: list[list[int]]) -> list[list[int]]:
    width = max(len(t) for t in tables)
    return [t + [0] * (width - len(t)) for t in tables]


class StepRunner:
    """rank: this process's ModelRunner (rank 0's). tp: at tensor_parallel_size > 1, the
    executor that sends each step's inputs to the other ranks and guards the collectives
    (common/parallel/executor.py); None at 1, where a step does nothing beyond the
    forward pass."""

    def __init__(self, rank: ModelRunner, tp=None):
        self.rank = rank
        self.block_size = rank.block_size
        self.device = rank.device
        self.tp = tp
        # (seq, first position, float32 logits [k, vocab]) of score rows; None: not kept
        self.on_prompt_logits: Callable[[Sequence, int, torch.Tensor], None] | None = None

    def plan(self, sched: SchedulerOutput) -> tuple[StepInputs, list[Sequence], list[ScoreSpan]]:
        """The step's inputs as ints (what every rank needs), its sampling sequences and
        its score spans (in the order of inputs.score_rows)."""
        bs = self.block_size
        inputs = StepInputs()
        input_ids, positions, slots = inputs.input_ids, inputs.positions, inputs.slots
        sample_rows = inputs.sample_rows
        sample_seqs: list[Sequence] = []
        spans: list[ScoreSpan] = []
        if sched.decode_seqs:
            lens = inputs.decode_lens = [len(s) for s in sched.decode_seqs]
            for i, s in enumerate(sched.decode_seqs):
                pos = lens[i] - 1
                input_ids.append(s.token_ids[pos])
                positions.append(pos)
                slots.append(s.block_ids[pos // bs] * bs + pos % bs)
            sample_rows.extend(range(len(lens)))
            sample_seqs.extend(sched.decode_seqs)
            inputs.decode_tables = _padded([s.block_ids for s in sched.decode_seqs])
        if sched.prefill_seqs:
            for s, n in zip(sched.prefill_seqs, sched.prefill_lens):
                begin, end = s.num_computed_tokens, s.num_computed_tokens + n
                input_ids.extend(s.token_ids[begin:end])
                positions.extend(range(begin, end))
                table = s.block_ids
                slots.extend(table[p // bs] * bs + p % bs for p in range(begin, end))
                inputs.query_lens.append(n)
                inputs.kv_lens.append(end)
                scored_end = min(end, s.num_prompt_tokens - 1)
                if s.wants_prompt_logits and scored_end > begin:
                    first_row = len(input_ids) - n
                    spans.append(ScoreSpan(s, begin, scored_end - begin, len(inputs.score_rows)))
                    inputs.score_rows.extend(range(first_row, first_row + scored_end - begin))
                if end == len(s):
                    sample_rows.append(len(input_ids) - 1)
                    sample_seqs.append(s)
            inputs.prefill_tables = _padded([s.block_ids for s in sched.prefill_seqs])
        return inputs, sample_seqs, spans

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, between_layers: Callable[[int], None] | None = None
                ) -> tuple[torch.Tensor | None, list[Sequence]]:
        """Run the step; returns float32 logits [len(sample_seqs), vocab] (None if no
        sequence samples this step) and the sequences they belong to. between_layers(i):
        called on this thread after layer i's attention (after the sequences' layer
        hooks), and with i = the number of layers before the logits. Score rows go to
        on_prompt_logits, slice by slice, before this returns. At tensor parallelism,
        RuntimeError when another rank failed (and every later step too)."""
        inputs, seqs, spans = self.plan(sched)
        on_scores = self._score_router(spans)
        if self.tp is None:
            return self.rank.forward(inputs, self._layer_hook(sched, between_layers), between_layers, on_scores), seqs
        with self.tp.step(inputs):
            return self.rank.forward(inputs, self._layer_hook(sched, between_layers), between_layers, on_scores), seqs

    def _score_router(self, spans: list[ScoreSpan]) -> Callable[[int, torch.Tensor], None] | None:
        """forward's on_scores for these spans: each slice cut at sequence boundaries and
        handed to on_prompt_logits; None when there is nothing to score or nobody to tell."""
        if not spans or self.on_prompt_logits is None:
            return None
        sink = self.on_prompt_logits

        def on_scores(offset: int, logits: torch.Tensor) -> None:
            end = offset + logits.shape[0]
            for span in spans:
                lo, hi = max(offset, span.offset), min(end, span.offset + span.num_rows)
                if lo < hi:
                    sink(span.seq, span.start + lo - span.offset, logits[lo - offset:hi - offset])

        return on_scores

    def _layer_hook(self, sched: SchedulerOutput, between_layers: Callable[[int], None] | None = None
                    ) -> Callable[[int], None] | None:
        """The forward pass's on_layer: each prefill sequence's on_computed.on_layer for its
        chunk, then between_layers; None when there is neither."""
        hooks = []
        for seq, n in zip(sched.prefill_seqs, sched.prefill_lens):
            on_layer = getattr(seq.on_computed, "on_layer", None)
            if on_layer is not None:
                start = seq.num_computed_tokens
                hooks.append((on_layer, seq, start, start + n))
        if not hooks:
            return between_layers
        device = self.device if self.device.type != "cpu" else None

        def on_layer(layer: int) -> None:
            if device is not None:
                torch.accelerator.synchronize(device)
            for hook, seq, start, end in hooks:
                hook(seq, layer, start, end)
            if between_layers is not None:
                between_layers(layer)

        return on_layer
