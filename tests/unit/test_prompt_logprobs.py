"""Prompt log-probabilities (SamplingParams.prompt_logprobs, LLM.prompt_logprobs_full)
equal transformers' log-softmax of a dense forward pass at every prompt position: in one
chunk and across chunks, after a cached prefix exists (no hit is used), under a
preemption before the first token (recomputed positions overwrite, never duplicate),
with top-k entries; their logits are computed SCORE_SLICE_ROWS rows at a time; bad
values name the field."""
from __future__ import annotations

import random

import pytest
import torch

from common.engine import SamplingParams
from common.runner.model_runner import SCORE_SLICE_ROWS
from common.engine.sampling_params import MAX_LOGPROBS
from common.parallel.step_wire import INLINE_LEN, pack, unpack
from common.runner.step_inputs import StepInputs
from tests.conftest import BLOCK_SIZE

TOL = 2e-4            # float32 engine vs float32 transformers, logprobs of magnitude ~10
GREEDY_ONE = dict(max_tokens=1, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(hf_saved_model):
    return hf_saved_model("llama-gqa")


@pytest.fixture(scope="module")
def reference(model_dir):
    """reference(ids) -> transformers' float32 log-softmax rows [len - 1, vocab]."""
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    @torch.inference_mode()
    def rows(ids: list[int]) -> torch.Tensor:
        return model(torch.tensor([ids])).logits[0, :-1].float().log_softmax(dim=-1)

    return rows


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1024) for _ in range(n)]


def assert_matches(ids: list[int], got: list, ref: torch.Tensor, k: int) -> None:
    """got (prompt_logprobs) against ref rows: None at 0; at p the actual token first with
    its logprob, then exactly transformers' top k (ids as a set, values within TOL)."""
    assert len(got) == len(ids) and got[0] is None
    for p in range(1, len(ids)):
        entry = got[p]
        assert next(iter(entry)) == ids[p], f"position {p}: the actual token is not first"
        assert abs(entry[ids[p]] - float(ref[p - 1, ids[p]])) < TOL, f"position {p}"
        top_values, top_ids = ref[p - 1].topk(k)
        assert set(entry) == {ids[p], *top_ids.tolist()}, f"position {p}: top {k} differ"
        for t, v in zip(top_ids.tolist(), top_values.tolist()):
            assert abs(entry[t] - v) < TOL, f"position {p}, token {t}"


@pytest.mark.parametrize("budget", [2048, 24], ids=["one-chunk", "chunked"])
def test_prompt_logprobs_equal_transformers_at_every_position(budget, model_dir, reference, llm_factory):
    llm = llm_factory(model_dir, num_blocks=128, block_size=BLOCK_SIZE, max_num_batched_tokens=budget)
    prompts = [prompt(n, seed) for seed, n in enumerate((1, 2, 17, 100, 300))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(prompt_logprobs=3, **GREEDY_ONE))
    assert outs[0].prompt_logprobs == [None]
    for ids, out in zip(prompts[1:], outs[1:]):
        assert_matches(ids, out.prompt_logprobs, reference(ids), 3)
        assert out.num_cached_tokens == 0
        assert out.outputs[0].token_ids == [int(reference(ids + [0])[-1].argmax())]   # the first token too


def test_full_distributions_equal_transformers(model_dir, reference, llm_factory):
    llm = llm_factory(model_dir, num_blocks=128, block_size=BLOCK_SIZE, max_num_batched_tokens=24)
    ids = prompt(130, seed=9)
    full = llm.prompt_logprobs_full(ids)
    assert full.dtype == torch.float32 and full.shape == (129, 1024)
    assert float((full - reference(ids)).abs().max()) < TOL
    assert llm.prompt_logprobs_full(ids[:1]).shape == (0, 1024)


def test_a_cached_prefix_is_not_used(model_dir, reference, llm_factory):
    """The prompt's blocks are in the prefix cache (a plain request computed them); the
    scored request recomputes every position, and hits nothing."""
    llm = llm_factory(model_dir, num_blocks=128, block_size=BLOCK_SIZE, max_num_batched_tokens=2048)
    ids = prompt(6 * BLOCK_SIZE + 5, seed=21)
    plain = llm.generate({"prompt_token_ids": ids}, SamplingParams(**GREEDY_ONE))[0]
    again = llm.generate({"prompt_token_ids": ids}, SamplingParams(**GREEDY_ONE))[0]
    assert (plain.num_cached_tokens, again.num_cached_tokens) == (0, 6 * BLOCK_SIZE)   # the cache works
    bm = llm.engine.block_manager
    hits_before = bm.num_hits
    scored = llm.generate({"prompt_token_ids": ids}, SamplingParams(prompt_logprobs=0, **GREEDY_ONE))[0]
    assert scored.num_cached_tokens == 0 and bm.num_hits == hits_before
    assert_matches(ids, scored.prompt_logprobs, reference(ids), 0)
    after = llm.generate({"prompt_token_ids": ids}, SamplingParams(**GREEDY_ONE))[0]
    assert after.num_cached_tokens == 6 * BLOCK_SIZE   # its blocks were cached like any other's


def test_preempted_before_its_first_token_overwrites_by_position(model_dir, reference, llm_factory):
    """15 blocks, steps of 2 blocks' tokens. A (7 blocks less 2 tokens) prefills in 4
    steps; B (7.5 blocks, scored) is admitted in the 4th with what A left (bs + 2 tokens)
    and takes 2bs - 1 a step beside A's decodes; the KV of A's third token needs an 8th
    block: B, the newest, is preempted with positions [0, 5 bs) delivered, waits until A
    ends, and is recomputed from position 0. The sink sees those positions twice
    (overwritten), the rest once; B's one StepOutput with prompt_logprobs equals
    transformers."""
    bs = BLOCK_SIZE
    engine = llm_factory(model_dir, num_blocks=15, block_size=bs, max_num_batched_tokens=2 * bs,
                         max_num_seqs=4).engine
    a, b = prompt(7 * bs - 2, seed=31), prompt(7 * bs + bs // 2, seed=32)
    delivered: list[int] = []
    preemptions = engine.scheduler.num_preemptions
    engine.add_request("pl-a", a, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    engine.add_request("pl-b", b, SamplingParams(prompt_logprobs=1, **GREEDY_ONE),
                       prompt_sink=lambda start, rows: delivered.extend(range(start, start + rows.shape[0])))
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    assert engine.scheduler.num_preemptions == preemptions + 1
    with_prompt = [o for o in outs if o.prompt_logprobs is not None]
    assert [o.request_id for o in with_prompt] == ["pl-b"]
    assert_matches(b, with_prompt[0].prompt_logprobs, reference(b), 1)
    assert delivered == list(range(5 * bs)) + list(range(len(b) - 1))
    assert len([t for o in outs if o.request_id == "pl-a" for t in o.new_token_ids]) == 10


def test_score_rows_are_computed_in_slices(model_dir, llm_factory, monkeypatch):
    """A 600-token prompt in one chunk: the sample row's logits, then 599 score rows in
    slices of SCORE_SLICE_ROWS."""
    llm = llm_factory(model_dir, num_blocks=128, block_size=BLOCK_SIZE, max_num_batched_tokens=2048)
    model = llm.engine.model
    real, rows = model.logits, []

    def logits(hidden):
        rows.append(hidden.shape[0])
        return real(hidden)

    monkeypatch.setattr(model, "logits", logits)
    llm.generate({"prompt_token_ids": prompt(600, seed=5)}, SamplingParams(prompt_logprobs=0, **GREEDY_ONE))
    assert SCORE_SLICE_ROWS == 256
    assert rows == [1, 256, 256, 87]


def test_step_inputs_carry_score_rows():
    inputs = StepInputs(input_ids=[5, 6, 7, 8], positions=[0, 1, 2, 3], slots=[0, 1, 2, 3], query_lens=[4],
                        kv_lens=[4], prefill_tables=[[0]], sample_rows=[3], score_rows=[0, 1, 2])
    wire = pack(inputs)
    assert wire.shape == (INLINE_LEN,) and unpack(wire) == inputs
    big = StepInputs(input_ids=list(range(3000)), positions=list(range(3000)), slots=list(range(3000)),
                     query_lens=[3000], kv_lens=[3000], prefill_tables=[list(range(188))], sample_rows=[2999],
                     score_rows=list(range(2999)))
    wire = pack(big)
    assert len(wire) > INLINE_LEN and unpack(wire[:INLINE_LEN], wire[8:]) == big


@pytest.mark.parametrize("value", [-1, MAX_LOGPROBS + 1, 2.0, "3"])
def test_bad_prompt_logprobs_name_the_field(value, model_dir, llm_factory):
    llm = llm_factory(model_dir, num_blocks=128, block_size=BLOCK_SIZE, max_num_batched_tokens=2048)
    with pytest.raises(ValueError, match=r"^prompts\[0\]: prompt_logprobs must be None or an integer in \[0, 20\], "):
        llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(prompt_logprobs=value))


def test_prompt_logprobs_below_the_vocabulary(tiny_model):
    with pytest.raises(ValueError, match=r"prompt_logprobs must be below the vocabulary size \(4\), got 4"):
        SamplingParams(prompt_logprobs=4).validate(vocab_size=4)


def test_a_remote_fill_cannot_score_the_prompt(model_dir, llm_factory):
    engine = llm_factory(model_dir, num_blocks=128, block_size=BLOCK_SIZE, max_num_batched_tokens=2048).engine
    with pytest.raises(ValueError, match=r"prompt_logprobs needs the prompt computed on this node: kv_remote"):
        engine.add_request("pl-remote", [5, 6, 7], SamplingParams(prompt_logprobs=0), kv_remote=True)
    with pytest.raises(ValueError, match=r"kv_remote must be False"):
        engine.add_request("pl-remote", [5, 6, 7], SamplingParams(), kv_remote=True, prompt_sink=lambda s, r: None)
    assert engine.scheduler.find("pl-remote") is None
