"""Expert load of a Mixture-of-Experts model: the tokens each MoE layer's router sent to
each of its experts since the engine started (each token counts once for each of its
top_k experts), the signal expert placement (EPLB) needs.

The model counts in its forward pass, on its device (SparseMoE.expert_tokens); this
moves those counts into engine-owned totals on the step thread, never while a forward
pass runs:

    step thread:  step ran the model -> after_step(idle) -> every DRAIN_EVERY_STEPS steps,
                  and at once when no sequence is left running (idle; an abort that
                  took the last one: on_idle()), drain():
                  model.expert_tokens() (one small copy per MoE layer, counters reset)
                  added into the totals, published as a new tensor
    any thread:   totals() reads the last published tensor (a reference: no lock)

So a reader sees counts up to DRAIN_EVERY_STEPS - 1 steps old while requests run, and
exact ones once the engine has none running. Dense models have no ExpertLoad (of_model
returns None): no drain, no cost. At tensor parallelism rank 0's model has the counts
of every token (every rank routes every token; the all_to_all dispatch all-gathers them).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

# a drain syncs the device once per MoE layer: amortized over this many steps
DRAIN_EVERY_STEPS = 16

CountsFn = Callable[[], dict[int, torch.Tensor]]


class ExpertLoad:
    """layer_ids: the MoE layers' indices, in order; source: the model's expert_tokens
    (layer index -> counts [num_experts] since its last call; resets the counters)."""

    def __init__(self, layer_ids: list[int], num_experts: int, source: CountsFn):
        if not layer_ids:
            raise ValueError("an ExpertLoad needs at least one MoE layer")
        self.layer_ids, self.num_experts, self._source = list(layer_ids), num_experts, source
        self._totals = torch.zeros(len(layer_ids), num_experts, dtype=torch.int64)   # replaced, never mutated
        self._steps = 0        # model steps since the last drain

    @classmethod
    def of_model(cls, model) -> ExpertLoad | None:
        """The model's ExpertLoad; None when it has no MoE layer. Before the model's first
        step (this drains what its counters hold, which should be nothing)."""
        source = getattr(model, "expert_tokens", None)
        counts = source() if source is not None else {}
        if not counts:
            return None
        layer_ids = sorted(counts)
        return cls(layer_ids, counts[layer_ids[0]].numel(), source)

    def after_step(self, idle: bool) -> None:
        """Step thread, after a step that ran the model; idle: no sequence is left running
        (the next model step may be far off), so drain now."""
        self._steps += 1
        if idle or self._steps >= DRAIN_EVERY_STEPS:
            self.drain()

    def on_idle(self) -> None:
        """No sequence is left running (an abort took the last one): drain if a step ran
        since the last drain. Same thread rule as drain()."""
        if self._steps:
            self.drain()

    def drain(self) -> None:
        """Step thread (or whoever holds the engine while no forward pass runs): add what
        the model counted since the last drain to the totals."""
        self._steps = 0
        counts = self._source()
        fresh = torch.stack([counts[i] for i in self.layer_ids]).to(torch.int64)
        self._totals = self._totals + fresh

    def totals(self) -> dict[int, list[int]]:
        """Layer index -> tokens routed to each expert (indexed by expert id) since the
        engine started, as of the last drain. Any thread, lock-free."""
        rows = self._totals.tolist()
        return dict(zip(self.layer_ids, rows))
