"""AsyncEngine hand-offs: a command runs at once on the caller's thread when the step
thread is idle, and queued in order behind a running step otherwise; a remote prefill
starts without waiting for a step; leaving during it cancels it before the blocks are
freed; a failed one falls back to local prefill with the offline engine's tokens; after
shutdown a call fails (EngineDeadError) instead of waiting forever."""
from __future__ import annotations

import asyncio
import threading

import pytest

from common.engine import AsyncEngine, SamplingParams
from common.engine.async_engine import EngineDeadError
from common.engine.remote_kv import KVFilled

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
PROMPT = list(range(3, 43))   # 40 tokens: 3 blocks of 16
HANG_GUARD_S = 30.0           # a wait's bound: only catches a hang, never a slow host


@pytest.fixture
def llm(tiny_model, llm_factory):
    """The session's shared engine with its prefix cache emptied before and after each
    test: FakeRemote's fill writes no KV, yet the prompt's blocks are registered as cached
    (garbage to any later test with the same prefix), and a prefix an earlier test cached
    would change what the tests here see (cached tokens, blocks used)."""
    llm = llm_factory(tiny_model("llama"), max_model_len=256)
    llm.engine.block_manager.reset_prefix_cache()
    yield llm
    llm.engine.block_manager.reset_prefix_cache()


@pytest.fixture
def reference(tiny_model, llm_factory):
    """Expected tokens, from an engine without a prefix cache."""
    return llm_factory(tiny_model("llama"), max_model_len=256, enable_prefix_caching=False)


def run_with(llm, scenario):
    engine = AsyncEngine(llm.engine)
    try:
        return asyncio.run(scenario(engine))
    finally:
        engine.shutdown()


def test_commands_run_at_once_when_idle_and_in_order_behind_a_step(llm):
    async def scenario(engine):
        caller = threading.get_ident()
        assert await engine._run_on_engine(threading.get_ident) == caller
        started, gate, order = threading.Event(), threading.Event(), []

        def busy():  # stands for a long step: holds the engine on the step thread
            started.set()
            gate.wait(HANG_GUARD_S)

        def record(i):
            order.append(i)
            return threading.get_ident()

        engine._submit(busy)
        assert await asyncio.to_thread(started.wait, HANG_GUARD_S)
        first = asyncio.ensure_future(engine._run_on_engine(lambda: record(1)))
        second = asyncio.ensure_future(engine._run_on_engine(lambda: record(2)))
        await asyncio.sleep(0.05)
        assert order == []
        gate.set()
        assert await asyncio.gather(first, second) == [engine._thread.ident] * 2
        assert order == [1, 2]
        await asyncio.to_thread(wait_idle, engine)
        assert await engine._run_on_engine(threading.get_ident) == caller  # idle again
    run_with(llm, scenario)


def wait_idle(engine) -> None:
    """Until the step thread has let go of the engine (it settles commands before)."""
    assert engine._engine_lock.acquire(timeout=HANG_GUARD_S)
    engine._engine_lock.release()


class FakeRemote:
    """A prefill node that answers first_token (or fails), or waits until cancelled."""

    def __init__(self, llm, first_token: int | None = 7, wait: bool = False):
        self.llm, self.first_token, self.wait = llm, first_token, wait
        self.events: list = []
        self.started = asyncio.Event()
        self.stop = asyncio.Event()

    async def fill(self, block_ids, num_cached_tokens):
        self.events.append(("run", list(block_ids), num_cached_tokens, self.llm.engine.num_used_blocks))
        self.started.set()
        if self.wait:
            await self.stop.wait()
            raise asyncio.CancelledError()
        if self.first_token is None:
            raise RuntimeError("prefill node unreachable")
        return KVFilled(len(PROMPT), self.first_token)

    async def cancel(self):
        self.events.append(("cancel", self.llm.engine.num_used_blocks))
        await asyncio.sleep(0.05)
        self.events.append("writes stopped")
        self.stop.set()
        return True

    async def settled(self):
        return None


def test_remote_prefill_starts_without_waiting_for_a_step(llm, monkeypatch):
    steps = []
    step = llm.engine.step
    monkeypatch.setattr(llm.engine, "step", lambda: steps.append(1) or step())

    async def scenario(engine):
        remote = FakeRemote(llm)
        outs = [out async for out in engine.generate("r", PROMPT, GREEDY, remote=remote)]
        return remote, outs

    remote, outs = run_with(llm, scenario)
    (event, block_ids, cached, used), = remote.events
    assert (event, len(block_ids), cached, used) == ("run", 3, 0, 3)
    assert outs[0].new_token_ids == [7]
    assert len(steps) == 3  # one per token 2..4: admission took no step
    assert [len(o.new_token_ids) for o in outs] == [1, 1, 1, 1]
    assert outs[-1].finished and outs[-1].finish_reason == "length"
    assert llm.engine.num_used_blocks == 0


def test_leaving_during_remote_prefill_cancels_it_before_freeing_blocks(llm):
    async def scenario(engine):
        remote = FakeRemote(llm, wait=True)

        async def consume():
            async for _ in engine.generate("r", PROMPT, GREEDY, remote=remote):
                pass

        task = asyncio.ensure_future(consume())
        await remote.started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return remote.events, (await engine.stats())["used_blocks"]

    events, used_after = run_with(llm, scenario)
    assert [e[0] if isinstance(e, tuple) else e for e in events] == ["run", "cancel", "writes stopped"]
    assert events[1] == ("cancel", 3)   # blocks still held while the prefill node stops
    assert used_after == 0


def test_failed_remote_prefill_falls_back_to_local_prefill(llm, reference):
    expected = reference.generate({"prompt_token_ids": PROMPT}, GREEDY)[0].outputs[0].token_ids

    async def scenario(engine):
        return [t async for out in engine.generate("r", PROMPT, GREEDY, remote=FakeRemote(llm, None))
                for t in out.new_token_ids]

    assert run_with(llm, scenario) == expected


def test_calls_after_shutdown_fail_instead_of_waiting_forever(llm):
    engine = AsyncEngine(llm.engine)

    async def scenario():
        started, gate = threading.Event(), threading.Event()

        def busy():
            started.set()
            gate.wait(HANG_GUARD_S)

        engine._submit(busy)
        assert await asyncio.to_thread(started.wait, HANG_GUARD_S)
        queued = asyncio.ensure_future(engine.release("nothing"))  # behind the busy step
        await asyncio.sleep(0.05)
        stopping = asyncio.ensure_future(asyncio.to_thread(engine.shutdown))
        await asyncio.sleep(0.05)
        gate.set()
        await stopping
        assert await asyncio.wait_for(queued, HANG_GUARD_S) is False   # queued before: it still ran
        with pytest.raises(EngineDeadError, match="shut down"):
            await engine.release("nothing")

    asyncio.run(scenario())


def test_a_request_that_cannot_be_admitted_does_not_spin_the_step_thread(tiny_model):
    """Every block held (a prefill node pushing its KV): the waiting request takes no step
    until a command frees blocks; then it runs."""
    from common.config import EngineConfig
    from common.engine.llm_engine import LLMEngine
    engine = LLMEngine(EngineConfig(str(tiny_model("llama")), num_blocks=4, max_model_len=64))
    steps = []
    step = engine.step
    engine.step = lambda: steps.append(1) or step()
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    async def scenario(async_engine):
        held = await async_engine.prefill("held", list(range(3, 60)), one)   # 4 blocks, kept
        waiting = asyncio.ensure_future(async_engine.prefill("next", list(range(3, 40)), one))
        await asyncio.sleep(0.3)
        idle_steps = len(steps)
        await async_engine.release("held")
        out = await waiting
        await async_engine.release("next")
        return held, out, idle_steps

    async_engine = AsyncEngine(engine)
    try:
        held, out, idle_steps = asyncio.run(scenario(async_engine))
    finally:
        async_engine.shutdown()
    assert held.finished and out.finished
    assert idle_steps <= 3   # the prompt of "held", then at most one empty try for "next"
    assert engine.stats()["used_blocks"] == 0


def test_a_step_s_outputs_wake_the_event_loop_once():
    """A step's tokens for many requests read on one loop cost one call_soon_threadsafe
    (one self-pipe write, one wake-up), not one per request; every reader gets its own."""
    import threading
    from types import SimpleNamespace
    from common.engine.async_engine import AsyncEngine
    from common.engine.llm_engine import StepOutput
    from common.engine.mailbox import Outbox

    async def main():
        loop = asyncio.get_running_loop()
        calls = []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: calls.append(a) or real(*a)
        boxes = {f"r{i}": Outbox(loop) for i in range(8)}
        readers = [asyncio.ensure_future(b.get()) for b in boxes.values()]
        await asyncio.sleep(0)                     # every reader waits
        outs = [StepOutput(rid, [i], False, None, 4, 0) for i, rid in enumerate(boxes)]
        step_thread = threading.Thread(target=AsyncEngine._deliver,
                                       args=(SimpleNamespace(_outboxes=boxes), outs))
        step_thread.start()
        step_thread.join()
        got = await asyncio.gather(*readers)
        assert [o.new_token_ids for o in got] == [[i] for i in range(8)]
        assert len(calls) == 1, "one wake-up for the whole step"
    asyncio.run(main())
