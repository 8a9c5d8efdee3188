"""The same request gives the same tokens alone, batched, with a warm prefix cache, with
chunked prefill of chunk 32, and after being preempted; seeded sampling likewise."""
from __future__ import annotations

import random

import pytest

from common.engine import SamplingParams
from tests.conftest import BLOCK_SIZE

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def batch_prompts(vocab: int, n: int = 16, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(1, 300))] for _ in range(n)]


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def target():
    rng = random.Random(11)
    return [rng.randrange(3, 1000) for _ in range(150)]


@pytest.fixture(scope="module")
def alone(model, llm_factory, target):
    llm = llm_factory(model, enable_prefix_caching=False)
    return llm.generate({"prompt_token_ids": target}, GREEDY)[0].outputs[0].token_ids


def test_batched_with_16_mixed_requests(model, llm_factory, target, alone):
    llm = llm_factory(model, enable_prefix_caching=False)
    prompts = batch_prompts(1000)
    prompts.insert(7, target)
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
              for m in [5, 40, 17, 33, 8, 64, 12, 3, 40, 22, 9, 50, 31, 2, 44, 19]] + [GREEDY]
    params[7], params[-1] = GREEDY, params[7]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert outs[7].outputs[0].token_ids == alone
    assert [len(o.outputs[0].token_ids) for o in outs] == [p.max_tokens for p in params]


def test_warm_prefix_cache(model, llm_factory, target, alone):
    llm = llm_factory(model, block_size=BLOCK_SIZE)
    first = llm.generate({"prompt_token_ids": target}, GREEDY)[0]
    second = llm.generate({"prompt_token_ids": target}, GREEDY)[0]
    assert first.outputs[0].token_ids == alone
    # every full block of the 150-token prompt but the one holding its last token
    assert second.num_cached_tokens == (150 - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert second.outputs[0].token_ids == alone


def test_chunked_prefill_of_chunk_32(model, llm_factory, target, alone):
    llm = llm_factory(model, max_num_batched_tokens=32, enable_prefix_caching=False)
    others = batch_prompts(1000, n=3, seed=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in [target, *others]], GREEDY)
    assert outs[0].outputs[0].token_ids == alone


def test_after_preemption(model, llm_factory, target, alone):
    llm = llm_factory(model, block_size=BLOCK_SIZE, num_blocks=384 // BLOCK_SIZE, max_model_len=384)
    before = llm.engine.scheduler.num_preemptions
    prompts = [target] + batch_prompts(1000, n=5, seed=9)
    prompts = [p[:150] for p in prompts]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert llm.engine.scheduler.num_preemptions > before
    assert outs[0].outputs[0].token_ids == alone


def test_seed_gives_same_tokens_alone_and_batched(model, llm_factory, target):
    llm = llm_factory(model, enable_prefix_caching=False)
    seeded = SamplingParams(max_tokens=30, temperature=0.9, top_p=0.9, top_k=50, seed=42,
                            ignore_eos=True)
    one = llm.generate({"prompt_token_ids": target}, seeded)[0].outputs[0].token_ids
    again = llm.generate({"prompt_token_ids": target}, seeded)[0].outputs[0].token_ids
    noisy = SamplingParams(max_tokens=30, temperature=1.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in batch_prompts(1000, n=5)]
    batch = llm.generate(prompts + [{"prompt_token_ids": target}], [noisy] * 5 + [seeded])
    assert one == again == batch[-1].outputs[0].token_ids
    other = SamplingParams(max_tokens=30, temperature=0.9, top_p=0.9, top_k=50, seed=43,
                           ignore_eos=True)
    assert llm.generate({"prompt_token_ids": target}, other)[0].outputs[0].token_ids != one


def test_stop_token_ids_max_tokens_and_eos(model, llm_factory, target, alone):
    llm = llm_factory(model, enable_prefix_caching=False)
    stop_at = alone[5]
    out = llm.generate({"prompt_token_ids": target},
                       SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[stop_at]))[0]
    first = alone.index(stop_at)
    assert out.outputs[0].token_ids == alone[:first + 1]
    assert out.outputs[0].finish_reason == "stop"
    out = llm.generate({"prompt_token_ids": target}, SamplingParams(max_tokens=3, temperature=0.0))[0]
    assert out.outputs[0].finish_reason in ("length", "stop") and len(out.outputs[0].token_ids) <= 3


def test_logprobs_are_the_model_distribution(model, llm_factory, target, alone):
    llm = llm_factory(model, enable_prefix_caching=False)
    out = llm.generate({"prompt_token_ids": target},
                       SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=3))[0]
    lps = out.outputs[0].logprobs
    assert len(lps) == 4
    for tok, entry in zip(out.outputs[0].token_ids, lps):
        assert len(entry) == 3 and tok in entry
        assert entry[tok] == max(entry.values()) and entry[tok] <= 0.0


def test_text_prompt_and_stop_string(model, llm_factory):
    llm = llm_factory(model, enable_prefix_caching=False)
    full = llm.generate("The quick brown fox", SamplingParams(max_tokens=24, temperature=0.0,
                                                              ignore_eos=True))[0].outputs[0]
    assert full.text == llm.tokenizer.decode(full.token_ids)
    text = full.text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    if not stop.strip():
        pytest.skip("generated text has no usable stop string")
    cut = llm.generate("The quick brown fox", SamplingParams(max_tokens=24, temperature=0.0,
                                                             ignore_eos=True, stop=[stop]))[0].outputs[0]
    assert cut.text == text[:text.index(stop)]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop


SEEDED = SamplingParams(max_tokens=30, temperature=0.8, seed=7, ignore_eos=True)


def run_engine(engine, requests: dict[str, tuple[list[int], SamplingParams, int]]) -> dict[str, list[int]]:
    """Step engine (an LLMEngine) until every request ends; requests: id -> (prompt,
    params, resume_position). Returns id -> output tokens."""
    got: dict[str, list[int]] = {rid: [] for rid in requests}
    for rid, (p, params, resume) in requests.items():
        engine.add_request(rid, p, params, resume_position=resume)
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id].extend(out.new_token_ids)
    return got


def test_seeded_sampling_survives_preemption(model, llm_factory, target):
    alone = llm_factory(model, enable_prefix_caching=False).generate(
        {"prompt_token_ids": target}, SEEDED)[0].outputs[0].token_ids
    llm = llm_factory(model, block_size=BLOCK_SIZE, num_blocks=384 // BLOCK_SIZE, max_model_len=384)
    before = llm.engine.scheduler.num_preemptions
    prompts = [target[:150]] + [p[:150] for p in batch_prompts(1000, n=5, seed=9)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [SEEDED] + [GREEDY] * 5)
    assert llm.engine.scheduler.num_preemptions > before
    assert outs[0].outputs[0].token_ids == alone


@pytest.mark.parametrize("position", [1, 7, 20])
def test_a_seeded_request_resumed_at_position_k_draws_what_it_would_have(model, llm_factory, target, position):
    """What migration does: prompt + the first k tokens, max_tokens - k more, resumed at
    output position k, on another engine and in a batch: the remaining tokens are the same."""
    whole = llm_factory(model, enable_prefix_caching=False).generate(
        {"prompt_token_ids": target}, SEEDED)[0].outputs[0].token_ids
    other = llm_factory(model, enable_prefix_caching=False).engine
    rest = SamplingParams(max_tokens=SEEDED.max_tokens - position, temperature=0.8, seed=7, ignore_eos=True)
    noisy = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    got = run_engine(other, {"resumed": (target + whole[:position], rest, position),
                             **{f"other-{i}": (p, noisy, 0) for i, p in enumerate(batch_prompts(1000, n=3))}})
    assert got["resumed"] == whole[position:]
    # not resumed (position 0 at that prompt): a different draw, so the position matters
    fresh = run_engine(other, {"fresh": (target + whole[:position], rest, 0)})["fresh"]
    assert fresh != whole[position:]


def test_resume_position_must_be_inside_the_prompt(model, llm_factory, target):
    engine = llm_factory(model, enable_prefix_caching=False).engine
    with pytest.raises(ValueError, match=r"resume_position must be in \[0, 150\)"):
        engine.add_request("bad", target, SEEDED, resume_position=150)
    assert not engine.has_unfinished()
