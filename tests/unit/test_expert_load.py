"""Expert load counted by the engine (common/engine/expert_load.py): the drain cadence with
exact totals, a dense model without any, and the tiny Qwen3-MoE model through the engine:
every MoE layer's counts sum to exactly the tokens computed through it times top_k
(prefix-cache hits excluded), fresh once no request runs, after an abort too."""
from __future__ import annotations

import torch

from common.engine import SamplingParams
from common.engine.expert_load import DRAIN_EVERY_STEPS, ExpertLoad
from tests.conftest import assert_no_blocks_in_use

PROMPT = list(range(5, 45))          # 40 tokens: 2 full blocks of 16 and 8 more


class FakeModel:
    """expert_tokens() as the model's: what was counted since the last call, then zero."""

    def __init__(self, layers: list[int], num_experts: int):
        self.pending = {i: torch.zeros(num_experts, dtype=torch.int64) for i in layers}
        self.num_calls = 0

    def route(self, layer: int, expert: int, n: int = 1) -> None:
        self.pending[layer][expert] += n

    def expert_tokens(self) -> dict[int, torch.Tensor]:
        self.num_calls += 1
        out = {i: c.clone() for i, c in self.pending.items()}
        for c in self.pending.values():
            c.zero_()
        return out


def test_totals_are_drained_every_n_steps_and_at_once_when_idle():
    model = FakeModel([1, 3], 4)
    load = ExpertLoad.of_model(model)
    assert (load.layer_ids, load.num_experts, model.num_calls) == ([1, 3], 4, 1)
    assert load.totals() == {1: [0, 0, 0, 0], 3: [0, 0, 0, 0]}
    for step in range(DRAIN_EVERY_STEPS - 1):
        model.route(1, 2)
        model.route(3, 0, 2)
        load.after_step(idle=False)
    assert load.totals() == {1: [0, 0, 0, 0], 3: [0, 0, 0, 0]} and model.num_calls == 1   # not yet drained
    model.route(1, 1)
    load.after_step(idle=False)                          # the DRAIN_EVERY_STEPS-th step
    n = DRAIN_EVERY_STEPS - 1
    assert load.totals() == {1: [0, 1, n, 0], 3: [2 * n, 0, 0, 0]} and model.num_calls == 2
    model.route(3, 3, 5)
    load.after_step(idle=True)                           # the last sequence finished: at once
    assert load.totals() == {1: [0, 1, n, 0], 3: [2 * n, 0, 0, 5]} and model.num_calls == 3
    load.on_idle()                                       # nothing ran since: no drain
    assert model.num_calls == 3
    model.route(1, 0)
    load.after_step(idle=False)
    load.on_idle()                                       # an abort took the last sequence
    assert load.totals() == {1: [1, 1, n, 0], 3: [2 * n, 0, 0, 5]} and model.num_calls == 4


def test_a_published_total_is_never_changed_by_a_later_drain():
    model = FakeModel([0], 2)
    load = ExpertLoad.of_model(model)
    model.route(0, 1, 3)
    load.drain()
    seen = load._totals
    model.route(0, 0, 4)
    load.drain()
    assert seen.tolist() == [[0, 3]] and load.totals() == {0: [4, 3]}


def test_a_dense_model_has_no_expert_load(llm_factory, tiny_model):
    assert ExpertLoad.of_model(object()) is None
    assert ExpertLoad.of_model(FakeModel([], 8)) is None
    llm = llm_factory(tiny_model("llama"), kernel_backend="cpu", num_blocks=64)
    llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert llm.engine.expert_load is None and llm.engine.expert_tokens() == {}
    assert_no_blocks_in_use(llm.engine)


def layer_sums(engine) -> dict[int, int]:
    return {i: sum(c) for i, c in engine.expert_tokens().items()}


def test_every_token_computed_through_a_moe_layer_is_counted_top_k_times(llm_factory, tiny_model):
    """A greedy request of P prompt tokens and M output tokens runs P + M - 1 tokens through
    every layer (the last token sampled is never fed back); the same prompt again computes
    only what the prefix cache did not hold (its 2 full blocks are hits)."""
    llm = llm_factory(tiny_model("qwen3_moe"), kernel_backend="cpu", num_blocks=64)
    engine = llm.engine
    engine.block_manager.reset_prefix_cache()
    top_k, layers = engine.model_config.num_experts_per_tok, engine.model_config.moe_layers
    assert (top_k, layers, engine.block_size) == (2, (0, 1, 2, 3), 16)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    before, hits = layer_sums(engine), engine.stats()["prefix_hit_tokens"]
    llm.generate([{"prompt_token_ids": PROMPT}], params)
    assert {i: n - before[i] for i, n in layer_sums(engine).items()} == dict.fromkeys(layers, (40 + 6 - 1) * top_k)
    assert engine.stats()["prefix_hit_tokens"] == hits
    llm.generate([{"prompt_token_ids": PROMPT}], params)
    assert engine.stats()["prefix_hit_tokens"] - hits == 32
    assert {i: n - before[i] for i, n in layer_sums(engine).items()} == \
        dict.fromkeys(layers, (40 + 5 + (40 - 32) + 5) * top_k)
    assert all(len(c) == 8 for c in engine.expert_tokens().values())
    assert_no_blocks_in_use(engine)


def test_counts_reach_the_totals_every_n_steps_and_when_an_abort_ends_the_last_request(llm_factory, tiny_model):
    llm = llm_factory(tiny_model("qwen3_moe"), kernel_backend="cpu", num_blocks=64)
    engine = llm.engine
    engine.block_manager.reset_prefix_cache()
    top_k, layers = engine.model_config.num_experts_per_tok, engine.model_config.moe_layers
    before = layer_sums(engine)
    engine.add_request("long", PROMPT, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    for _ in range(DRAIN_EVERY_STEPS - 1):        # the prefill, then decode steps: not drained yet
        engine.step()
    assert layer_sums(engine) == before
    engine.step()                                 # 1 prefill of 40 + DRAIN_EVERY_STEPS - 1 decodes
    ran = 40 + DRAIN_EVERY_STEPS - 1
    assert {i: n - before[i] for i, n in layer_sums(engine).items()} == dict.fromkeys(layers, ran * top_k)
    engine.step()
    engine.step()
    assert {i: n - before[i] for i, n in layer_sums(engine).items()} == dict.fromkeys(layers, ran * top_k)
    assert engine.abort("long")
    assert {i: n - before[i] for i, n in layer_sums(engine).items()} == dict.fromkeys(layers, (ran + 2) * top_k)
    assert_no_blocks_in_use(engine)
