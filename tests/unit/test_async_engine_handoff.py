"""AsyncEngine's forward window: while a step's forward pass runs, a remote prefill is
admitted (its fill starts) and its first token reaches the stream, and the sequence
joins the batch at the next step boundary; a held request's blocks are released; a
command that may touch the batch (abort), and whatever is queued behind it, waits for the
boundary. The step is held deterministically: the forward pass waits on a gate."""
from __future__ import annotations

import asyncio
import threading

import pytest

from common.engine import SamplingParams
from common.engine.block_manager import BlockManager
from common.engine.remote_kv import KVFilled
from common.engine.scheduler import Scheduler
from common.engine.sequence import Sequence
from tests.unit.test_async_engine import run_with

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
LOCAL = list(range(3, 43))            # 40 tokens: 3 blocks of 16
REMOTE = list(range(100, 150))        # 50 tokens: 4 blocks
HANG_GUARD_S = 30.0                   # a wait's bound: only catches a hang, never a slow host


@pytest.fixture
def llm(tiny_model, llm_factory):
    """An engine (prefix cache) of its own, emptied before and after each test:
    AnsweringRemote writes no KV, yet REMOTE's blocks are registered as cached, and
    REMOTE prefilled here by one test would be a cache hit to the next."""
    llm = llm_factory(tiny_model("llama"), max_model_len=224)
    llm.engine.block_manager.reset_prefix_cache()
    yield llm
    llm.engine.block_manager.reset_prefix_cache()


class HeldForward:
    """Stands in for the model runner: records each step's batch; the forward pass of the
    first step waits until `gate` is set (the test sets it)."""

    def __init__(self, runner, monkeypatch):
        self.execute = runner.execute
        self.gate, self.entered = threading.Event(), threading.Event()
        self.batches: list[list[str]] = []
        monkeypatch.setattr(runner, "execute", self)

    def __call__(self, sched, between_layers=None):
        self.batches.append(sorted(s.request_id for s in (*sched.decode_seqs, *sched.prefill_seqs)))
        self.entered.set()
        assert self.gate.wait(2 * HANG_GUARD_S), "the test never opened the gate"
        return self.execute(sched, between_layers)

    @property
    def held(self) -> bool:
        """The first step's forward pass is still running."""
        return self.entered.is_set() and not self.gate.is_set() and len(self.batches) == 1


class AnsweringRemote:
    """A prefill node that answers first token 7 at once, noting whether the step was held."""

    def __init__(self, forward: HeldForward):
        self.forward = forward
        self.filled_while_held: bool | None = None

    async def fill(self, block_ids, num_cached_tokens):
        self.filled_while_held = self.forward.held
        return KVFilled(len(REMOTE), 7)

    async def cancel(self):
        return True

    async def settled(self):
        return None




async def tokens(stream) -> list[list[int]]:
    return [out.new_token_ids async for out in stream]


async def done_while_held(aw, forward: HeldForward, timeout_s: float = HANG_GUARD_S) -> tuple[asyncio.Future, bool]:
    """Start aw; whether it finished while the step's forward pass was still held (waiting
    at most timeout_s: before the fix it waits for the gate, which only the test opens)."""
    task = asyncio.ensure_future(aw)
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    return task, bool(done) and forward.held


def test_a_remote_first_token_is_delivered_while_a_decode_step_runs(llm, monkeypatch):
    forward = HeldForward(llm.engine.runner, monkeypatch)

    async def scenario(engine):
        local = asyncio.ensure_future(tokens(engine.generate("local", LOCAL, GREEDY)))
        try:
            assert await asyncio.to_thread(forward.entered.wait, HANG_GUARD_S)
            remote = AnsweringRemote(forward)
            stream = engine.generate("remote", REMOTE, GREEDY, remote=remote)
            first, delivered_while_held = await done_while_held(anext(stream), forward)
        finally:
            forward.gate.set()
        first = await first
        rest = await tokens(stream)
        return remote, first, delivered_while_held, rest, await local

    remote, first, delivered_while_held, rest, local = run_with(llm, scenario)
    assert delivered_while_held is True
    assert (first.new_token_ids, first.finished) == ([7], False)
    assert remote.filled_while_held is True       # admitted and its fill started during the step
    assert forward.batches[:2] == [["local"], ["local", "remote"]]   # joined at the next step
    assert [len(t) for t in rest] == [1, 1, 1]
    assert [len(t) for t in local] == [1, 1, 1, 1]
    assert llm.engine.num_used_blocks == 0


def test_a_held_request_is_released_while_a_step_runs(llm, monkeypatch):
    """The prefill node's release after its KV push does not wait for its next step."""
    async def scenario(engine):
        one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        await engine.prefill("held", REMOTE, one)
        forward = HeldForward(llm.engine.runner, monkeypatch)
        local = asyncio.ensure_future(tokens(engine.generate("local", LOCAL, GREEDY)))
        try:
            assert await asyncio.to_thread(forward.entered.wait, HANG_GUARD_S)
            released, while_held = await done_while_held(engine.release("held"), forward)
        finally:
            forward.gate.set()
        await local
        return await released, while_held

    assert run_with(llm, scenario) == (True, True)


def test_an_abort_and_every_command_behind_it_wait_for_the_step_boundary(llm, monkeypatch):
    forward = HeldForward(llm.engine.runner, monkeypatch)
    order: list[str] = []

    async def scenario(engine):
        caller = threading.get_ident()
        local = asyncio.ensure_future(tokens(engine.generate("local", LOCAL, GREEDY)))
        try:
            assert await asyncio.to_thread(forward.entered.wait, HANG_GUARD_S)
            ran_on = await engine._run_on_engine(lambda: order.append("a") or threading.get_ident(),
                                                 in_forward=True)
            abort = asyncio.ensure_future(engine._run_on_engine(lambda: order.append("abort")))
            behind = asyncio.ensure_future(engine._run_on_engine(lambda: order.append("c"), in_forward=True))
            for _ in range(20):
                await asyncio.sleep(0.005)
            during = (list(order), abort.done(), behind.done(), forward.held)
        finally:
            forward.gate.set()
        await asyncio.gather(abort, behind)
        await local
        return ran_on == caller, during

    on_caller, during = run_with(llm, scenario)
    assert on_caller
    assert during == (["a"], False, False, True)
    assert order == ["a", "abort", "c"]


def _seq(rid: str, n: int, arrival: int, kv_remote: bool = False) -> Sequence:
    return Sequence(rid, list(range(1, n + 1)), SamplingParams(max_tokens=8), arrival, kv_remote=kv_remote)


def test_admit_remote_passes_local_prefills_only_with_what_they_leave_and_room_for_the_batch():
    bm = BlockManager(8, 16)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=256)
    admitted: list[str] = []
    sched.on_remote_admit = lambda s: admitted.append(s.request_id)
    running = _seq("running", 20, 0)
    sched.add(running)
    sched.schedule()                                  # running: 2 blocks, 6 free
    r1, local, r2 = _seq("r1", 40, 1, True), _seq("local", 10, 2), _seq("r2", 16, 3, True)
    for s in (r1, local, r2):
        sched.add(s)
    sched.admit_remote()
    # r2 passes local (which waits for a step's budget): 1 block each, 1 for running's next token
    assert admitted == ["r1", "r2"] and list(sched.waiting) == [local]
    assert (r1.block_ids, r2.block_ids, bm.num_free_blocks) == ([2, 3, 4], [5], 2)
    r3 = _seq("r3", 16, 4, True)                      # would take the block local's prompt needs
    sched.add(r3)
    sched.admit_remote()
    assert admitted == ["r1", "r2"] and list(sched.waiting) == [local, r3]
    sched.abort(local)
    sched.admit_remote()                              # local gone: r3 fits
    assert admitted == ["r1", "r2", "r3"] and bm.num_free_blocks == 1
    big = _seq("big", 32, 5, True)                    # 2 blocks: none left for the batch's next tokens
    sched.add(big)
    sched.admit_remote()
    assert admitted == ["r1", "r2", "r3"] and list(sched.waiting) == [big]
    for s in (running, r1, r2, r3, big):
        sched.abort(s)
    assert bm.num_used_blocks == 0


def test_a_step_admits_a_remote_prefill_behind_local_ones_once_blocks_free():
    bm = BlockManager(8, 16)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=32)
    admitted: list[str] = []
    sched.on_remote_admit = lambda s: admitted.append(s.request_id)
    first = _seq("first", 40, 0)
    sched.add(first)
    sched.schedule()                                  # first: 3 blocks, 5 free
    local, remote = _seq("local", 64, 1), _seq("remote", 16, 2, True)
    sched.add(local)
    sched.add(remote)
    sched.admit_remote()                              # local's 4 blocks + 1 for first's next token: no room
    assert admitted == [] and list(sched.waiting) == [local, remote]
    sched.abort(first)                                # blocks free; no new remote request comes
    sched.schedule()                                  # local takes the whole budget; remote needs none
    assert admitted == ["remote"] and [s.request_id for s in sched.running] == ["local"]
    assert (remote.block_ids, local.block_ids) == ([0], [1, 2, 3, 4])
    for s in (local, remote):
        sched.abort(s)
    assert bm.num_used_blocks == 0
