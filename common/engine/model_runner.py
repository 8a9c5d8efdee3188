"""Runs one scheduled step through the model: builds inputs and attention metadata once,
runs the forward pass, returns the logits of the sequences that sample this step.

Token packing of a step:
    [ d_0 d_1 ... d_{D-1} | p_0 chunk | p_1 chunk | ... ]
      one token per decode   consecutive tokens of each prefill chunk
A prefill chunk samples only when it reaches the end of its sequence's tokens.

Layer hooks: a prefill sequence whose `on_computed` has an `on_layer` attribute gets
`on_computed.on_layer(seq, layer, start, end)` on the step thread inside the forward pass,
right after layer `layer` wrote the KV of its chunk's tokens [start, end) (in layer order,
every layer, before the step's `on_computed(seq, start, end)`); on a device the runner
first waits for the kernels queued so far, so the callee may read those bytes at once.
"""
from __future__ import annotations

from typing import Callable

import torch

from common.engine.scheduler import SchedulerOutput
from common.engine.sequence import Sequence
from common.model.llama import CausalLM, StepBatch
from kernels import DecodeMetadata, PrefillMetadata


def _block_table(seqs: list[Sequence], device: torch.device) -> torch.Tensor:
    width = max(len(s.block_ids) for s in seqs)
    rows = [s.block_ids + [0] * (width - len(s.block_ids)) for s in seqs]
    return torch.tensor(rows, dtype=torch.int32, device=device)


class ModelRunner:
    def __init__(self, model: CausalLM, kv_cache: torch.Tensor, block_size: int):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = kv_cache.device

    def prepare(self, sched: SchedulerOutput) -> tuple[torch.Tensor, StepBatch, list[int], list[Sequence]]:
        """(input_ids, batch, logits row indices, sampling sequences) for a step."""
        bs, dev = self.block_size, self.device
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        decode = prefill = None
        if sched.decode_seqs:
            lens = [len(s) for s in sched.decode_seqs]
            for i, s in enumerate(sched.decode_seqs):
                pos = lens[i] - 1
                input_ids.append(s.token_ids[pos])
                positions.append(pos)
                slots.append(s.block_ids[pos // bs] * bs + pos % bs)
            sample_rows.extend(range(len(lens)))
            sample_seqs.extend(sched.decode_seqs)
            decode = DecodeMetadata(seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
                                    block_tables=_block_table(sched.decode_seqs, dev),
                                    seq_lens_list=lens)
        if sched.prefill_seqs:
            q_lens, kv_lens, starts = [], [], [0]
            for s, n in zip(sched.prefill_seqs, sched.prefill_lens):
                begin, end = s.num_computed_tokens, s.num_computed_tokens + n
                input_ids.extend(s.token_ids[begin:end])
                positions.extend(range(begin, end))
                table = s.block_ids
                slots.extend(table[p // bs] * bs + p % bs for p in range(begin, end))
                q_lens.append(n)
                kv_lens.append(end)
                starts.append(starts[-1] + n)
                if end == len(s):
                    sample_rows.append(len(input_ids) - 1)
                    sample_seqs.append(s)
            prefill = PrefillMetadata(
                query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
                seq_lens=torch.tensor(kv_lens, dtype=torch.int32, device=dev),
                block_tables=_block_table(sched.prefill_seqs, dev),
                query_lens_list=q_lens, seq_lens_list=kv_lens)
        batch = StepBatch(
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            num_decode_tokens=len(sched.decode_seqs), decode=decode, prefill=prefill)
        ids = torch.tensor(input_ids, dtype=torch.int64, device=dev)
        return ids, batch, sample_rows, sample_seqs

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> tuple[torch.Tensor | None, list[Sequence]]:
        """Run the step; returns float32 logits [len(sample_seqs), vocab] (None if no
        sequence samples this step) and the sequences they belong to."""
        input_ids, batch, rows, seqs = self.prepare(sched)
        hidden = self.model(input_ids, batch, self.kv_cache, self._layer_hook(sched))
        if not rows:
            return None, []
        if len(rows) != hidden.shape[0]:
            hidden = hidden[torch.tensor(rows, device=self.device)]
        return self.model.logits(hidden), seqs

    def _layer_hook(self, sched: SchedulerOutput) -> Callable[[int], None] | None:
        """The forward pass's on_layer: each prefill sequence's on_computed.on_layer for its
        chunk; None when no sequence of the step has one."""
        hooks = []
        for seq, n in zip(sched.prefill_seqs, sched.prefill_lens):
            on_layer = getattr(seq.on_computed, "on_layer", None)
            if on_layer is not None:
                start = seq.num_computed_tokens
                hooks.append((on_layer, seq, start, start + n))
        if not hooks:
            return None
        device = self.device if self.device.type != "cpu" else None

        def on_layer(layer: int) -> None:
            if device is not None:
                torch.accelerator.synchronize(device)
            for hook, seq, start, end in hooks:
                hook(seq, layer, start, end)

        return on_layer
