"""Bad input is a ValueError naming the field and its range, raised before anything is
scheduled; other requests are unaffected."""
from __future__ import annotations

import asyncio

import pytest

from common.engine import AsyncEngine, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model, llm_factory):
    return llm_factory(tiny_model("llama"), max_model_len=256, enable_prefix_caching=False)


BAD = [
    ({"prompt_token_ids": []}, SamplingParams(), "prompt must not be empty"),
    ("", SamplingParams(), "prompt must not be empty"),
    ({"prompt_token_ids": [5, 1024]}, SamplingParams(), r"prompt_token_ids\[1\]=1024 is outside the vocabulary \[0, 1024\)"),
    ({"prompt_token_ids": [5] * 250}, SamplingParams(max_tokens=10), r"must be <= max_model_len \(256\)"),
    ({"prompt_token_ids": [5]}, SamplingParams(max_tokens=0), "max_tokens must be an integer >= 1"),
    ({"prompt_token_ids": [5]}, SamplingParams(temperature=-0.1), "temperature must be >= 0"),
    ({"prompt_token_ids": [5]}, SamplingParams(top_p=1.5), r"top_p must be in \(0, 1\]"),
    ({"prompt_token_ids": [5]}, SamplingParams(top_p=0.0), r"top_p must be in \(0, 1\]"),
    ({"prompt_token_ids": [5]}, SamplingParams(top_k=0), "top_k must be -1"),
    ({"prompt_token_ids": [5]}, SamplingParams(top_k=-2), "top_k must be -1"),
]


@pytest.mark.parametrize("prompt,params,message", BAD)
def test_bad_input_raises_before_scheduling(llm, prompt, params, message):
    good = {"prompt_token_ids": [5, 6, 7]}
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with pytest.raises(ValueError, match=message):
        llm.generate([good, prompt], [greedy, params])
    assert not llm.engine.has_unfinished()
    assert llm.generate(good, greedy)[0].outputs[0].finish_reason == "length"


def test_async_engine_rejects_bad_request_while_others_run(llm):
    engine = AsyncEngine(llm.engine)
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    expected = llm.generate({"prompt_token_ids": [9, 8, 7, 6]}, greedy)[0].outputs[0].token_ids

    async def scenario():
        async def collect(rid):
            toks = []
            async for out in engine.generate(rid, [9, 8, 7, 6], greedy):
                toks.extend(out.new_token_ids)
            return toks

        task = asyncio.create_task(collect("good"))
        await asyncio.sleep(0)
        for prompt, params, message in BAD:
            ids = prompt["prompt_token_ids"] if isinstance(prompt, dict) else []
            with pytest.raises(ValueError, match=message):
                async for _ in engine.generate("bad", ids, params):
                    pass
        return await task

    try:
        assert asyncio.run(scenario()) == expected
    finally:
        engine.shutdown()


def test_async_abort_frees_blocks_at_once(llm):
    engine = AsyncEngine(llm.engine)
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)

    async def scenario():
        seen = []
        async for out in engine.generate("long", list(range(3, 40)), params):
            seen.extend(out.new_token_ids)
            if len(seen) == 3 and not out.finished:
                assert (await engine.stats())["used_blocks"] > 0
                assert await engine.abort("long")
                assert (await engine.stats())["used_blocks"] == 0
            if out.finished:
                assert out.finish_reason == "abort"
        return seen

    try:
        assert len(asyncio.run(scenario())) == 3
    finally:
        engine.shutdown()


def test_async_client_leaving_early_aborts(llm):
    engine = AsyncEngine(llm.engine)
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)

    async def scenario():
        gen = engine.generate("leave", list(range(3, 40)), params)
        async for out in gen:
            break
        await gen.aclose()
        return await engine.stats()

    try:
        assert asyncio.run(scenario())["used_blocks"] == 0
    finally:
        engine.shutdown()


def test_async_engine_after_shutdown_fails_fast_and_never_strands_a_caller(llm):
    """A call made once the engine is shut down is an EngineDeadError at once (a node's
    background task finishing during shutdown must not wait forever)."""
    from common.engine.async_engine import EngineDeadError
    engine = AsyncEngine(llm.engine)

    async def scenario():
        assert (await engine.stats())["used_blocks"] == 0
        engine.shutdown()
        with pytest.raises(EngineDeadError, match="shut down"):
            await asyncio.wait_for(engine.release("gone"), 5)
        with pytest.raises(EngineDeadError, match="shut down"):
            async for _ in engine.generate("late", [5, 6], SamplingParams(max_tokens=2)):
                pass

    asyncio.run(scenario())


def test_logprobs_must_be_below_the_vocabulary_size():
    """topk(n) over a vocabulary smaller than n would raise in the step thread (and end
    the engine): refused at validation instead."""
    SamplingParams(logprobs=3).validate(vocab_size=4)
    with pytest.raises(ValueError, match=r"logprobs must be below the vocabulary size \(4\), got 4"):
        SamplingParams(logprobs=4).validate(vocab_size=4)
