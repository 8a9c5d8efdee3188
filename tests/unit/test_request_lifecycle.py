"""A disaggregated request through the engine's one state machine (AsyncEngine + a
prefill engine in this process that copies real KV into the decode engine's blocks):
preempted after its remote prefill it is recomputed here, never re-committed; its first
token keeps its place however late the event loop runs; blocks whose remote writer has
not confirmed it stopped stay QUARANTINED (never handed out) until it has."""
from __future__ import annotations

import asyncio
import random
import time

import pytest

from common.config import EngineConfig
from common.engine import AsyncEngine, SamplingParams
from common.engine.lifecycle import IllegalTransition, RequestState, advance
from common.engine.llm_engine import LLMEngine
from tests.in_process_prefill import InProcessPrefill

GREEDY = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(rng.randrange(30, 60))] for _ in range(n)]


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def reference(model, llm_factory):
    return llm_factory(model, max_model_len=256)


def expected_tokens(reference, ps, params=GREEDY):
    return [o.outputs[0].token_ids for o in reference.generate([{"prompt_token_ids": p} for p in ps], params)]


def engine_of(model, num_blocks: int) -> LLMEngine:
    return LLMEngine(EngineConfig(str(model), num_blocks=num_blocks, max_model_len=min(256, 16 * num_blocks)))


def assert_idle(engine: LLMEngine) -> None:
    stats = engine.stats()
    assert (stats["used_blocks"], stats["quarantined_blocks"], stats["running"], stats["waiting"],
            stats["kv_remote"], stats["held"]) == (0, 0, 0, 0, 0, 0), stats


async def until_unquarantined(engine: AsyncEngine, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (await engine.stats())["quarantined_blocks"]:
        assert time.monotonic() < deadline, "the quarantine did not end once the writer settled"
        await asyncio.sleep(0.01)


async def collect(engine: AsyncEngine, rid: str, prompt, params=GREEDY, remote=None) -> list[int]:
    return [t async for out in engine.generate(rid, prompt, params, remote=remote) for t in out.new_token_ids]


def test_preempted_remote_prefills_are_recomputed_not_recommitted(model, reference):
    ps = prompts(8, seed=3)
    want = expected_tokens(reference, ps)
    decode, prefill = engine_of(model, 20), engine_of(model, 64)   # 20 blocks: preemption certain

    async def scenario():
        engine = AsyncEngine(decode)
        try:
            return await asyncio.gather(*(
                collect(engine, f"r{i}", p, remote=InProcessPrefill(prefill, decode, f"r{i}", p, GREEDY))
                for i, p in enumerate(ps)))
        finally:
            engine.shutdown()

    got = asyncio.run(scenario())
    assert decode.scheduler.num_preemptions > 0
    assert got == want
    assert_idle(decode)
    assert_idle(prefill)


@pytest.mark.parametrize("stall_s", [0.02, 0.3])
def test_first_token_keeps_its_place_when_the_event_loop_stalls(model, reference, stall_s):
    """Local requests keep the step thread busy, so each remote commit waits behind a step;
    the loop then stalls right after the commit was handed over."""
    remote_ps, local_ps = prompts(6, seed=5), prompts(2, seed=6)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    long_params = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    want = expected_tokens(reference, remote_ps, params)
    want_local = expected_tokens(reference, local_ps, long_params)
    decode, prefill = engine_of(model, 256), engine_of(model, 64)

    def stall(loop):
        loop.call_later(0.001, time.sleep, stall_s)

    async def scenario():
        engine = AsyncEngine(decode)
        try:
            local = [asyncio.ensure_future(collect(engine, f"l{i}", p, long_params)) for i, p in enumerate(local_ps)]
            await asyncio.sleep(0.05)
            remote = await asyncio.gather(*(
                collect(engine, f"r{i}", p, params, InProcessPrefill(prefill, decode, f"r{i}", p, params, stall))
                for i, p in enumerate(remote_ps)))
            return remote, await asyncio.gather(*local)
        finally:
            engine.shutdown()

    got, got_local = asyncio.run(scenario())
    assert got == want
    assert got_local == want_local
    assert_idle(decode)


class UnconfirmedRemote:
    """A prefill node that never confirms its writes stopped until `settle` is set: fill
    hangs (or fails at once with fail=True), cancel answers False."""

    def __init__(self, fail: bool = False):
        self.fail = fail
        self.started = asyncio.Event()
        self.settle = asyncio.Event()
        self.block_ids: list[int] = []

    async def fill(self, block_ids, num_cached_tokens):
        self.block_ids = list(block_ids)
        self.started.set()
        if self.fail:
            raise ConnectionError("prefill node went silent")
        await asyncio.Event().wait()

    async def cancel(self) -> bool:
        return False

    async def settled(self) -> None:
        await self.settle.wait()


def test_blocks_of_an_unconfirmed_cancel_stay_quarantined_until_settled(model, reference):
    p, other = prompts(2, seed=9)
    want_other = expected_tokens(reference, [other])[0]
    decode = engine_of(model, 12)   # the quarantined request holds 3-4 of them

    async def scenario():
        engine = AsyncEngine(decode)
        try:
            remote = UnconfirmedRemote()
            task = asyncio.ensure_future(collect(engine, "q", p, remote=remote))
            await remote.started.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            stats = await engine.stats()
            assert stats["quarantined_blocks"] == len(remote.block_ids) == stats["used_blocks"]
            # another request runs meanwhile, never in a quarantined block
            got_other = await collect(engine, "o", other)
            bm = decode.block_manager
            assert all(bm.blocks[b].ref_count == 1 and b not in bm.free_queue for b in remote.block_ids)
            assert (await engine.stats())["quarantined_blocks"] == len(remote.block_ids)
            remote.settle.set()
            await until_unquarantined(engine)
            return got_other
        finally:
            engine.shutdown()

    assert asyncio.run(scenario()) == want_other
    assert_idle(decode)


def test_failed_fill_with_an_unconfirmed_writer_is_recomputed_in_fresh_blocks(model, reference):
    p = prompts(1, seed=11)[0]
    want = expected_tokens(reference, [p])[0]
    decode = engine_of(model, 24)

    async def scenario():
        engine = AsyncEngine(decode)
        try:
            remote = UnconfirmedRemote(fail=True)
            seen: list[int] = []
            tokens = []
            async for out in engine.generate("f", p, GREEDY, remote=remote):
                tokens += out.new_token_ids
                seen.append((await engine.stats())["quarantined_blocks"])
            old = set(remote.block_ids)
            still = (await engine.stats())["quarantined_blocks"]
            remote.settle.set()
            await until_unquarantined(engine)
            return tokens, seen, still, old
        finally:
            engine.shutdown()

    tokens, seen, still, old = asyncio.run(scenario())
    assert tokens == want
    assert set(seen) == {len(old)} and still == len(old)   # quarantined the whole time
    assert_idle(decode)


def test_lifecycle_refuses_transitions_it_does_not_have():
    class Seq:
        request_id, state = "x", RequestState.WAITING

    seq = Seq()
    advance(seq, RequestState.ALLOCATED)
    advance(seq, RequestState.KV_REMOTE)
    with pytest.raises(IllegalTransition, match="KV_REMOTE -> RUNNING"):
        advance(seq, RequestState.RUNNING)   # only through KV_READY: the KV must have landed
    advance(seq, RequestState.QUARANTINED)
    with pytest.raises(IllegalTransition):
        advance(seq, RequestState.WAITING)
    advance(seq, RequestState.ABORTED)
    assert seq.state.done
