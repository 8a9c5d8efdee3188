"""bench/engine_core.py, the engine core in its own process: its tokens are the
in-process engine's, token for token; leaving a stream aborts the request in the core;
after shutdown the child process is gone and a new request fails EngineDeadError."""
from __future__ import annotations

import asyncio
import random
import sys
from pathlib import Path

import pytest

from common.engine import SamplingParams
from common.engine.async_engine import EngineDeadError

sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))   # after the repo: bench/kernels.py
from engine_core import EngineCoreClient  # noqa: E402

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def prompts(n: int = 4, seed: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(rng.randrange(5, 90))] for _ in range(n)]


def params_for(i: int) -> SamplingParams:
    return SamplingParams(max_tokens=GREEDY.max_tokens + 3 * i, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model, llm_factory):
    return llm_factory(tiny_model("llama"), max_model_len=256)


async def collect(core: EngineCoreClient, rid: str, prompt: list[int], params: SamplingParams) -> list[int]:
    tokens = []
    async for out in core.generate(rid, prompt, params):
        tokens.extend(out.new_token_ids)
        if out.finished:
            assert out.finish_reason == "length" and out.num_prompt_tokens == len(prompt)
    return tokens


def test_core_process_gives_the_in_process_tokens_and_is_gone_after_close(llm):
    ps = prompts()
    expected = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps],
                                                             [params_for(i) for i in range(len(ps))])]
    core = EngineCoreClient(llm.engine.config)

    async def scenario():
        got = await asyncio.gather(*(collect(core, f"r{i}", p, params_for(i)) for i, p in enumerate(ps)))
        assert got == expected
        assert core.step_s and core.num_waiting() == 0
        stream = core.generate("left", ps[0], SamplingParams(max_tokens=150, temperature=0.0, ignore_eos=True))
        await anext(stream)
        await stream.aclose()   # leaving early aborts it in the core; the id is free again
        assert await collect(core, "left", ps[0], params_for(0)) == expected[0]
        with pytest.raises(ValueError, match="max_model_len"):
            core.validate("long", ps[0], SamplingParams(max_tokens=1000))
        core.shutdown()
        assert not core.process.is_alive() and core.process.exitcode == 0
        with pytest.raises(EngineDeadError):
            await collect(core, "after", ps[0], GREEDY)

    try:
        asyncio.run(scenario())
    finally:
        core.shutdown()
    assert not core.process.is_alive()
