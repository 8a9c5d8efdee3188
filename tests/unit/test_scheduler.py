"""Scheduler: chunked prefill under the token budget, seat limit, preemption by recompute.
Driven without a model: `advance` plays the model's part of a step."""
from common.engine.block_manager import BlockManager
from common.engine.sampling_params import SamplingParams
from common.engine.scheduler import Scheduler
from common.engine.lifecycle import RequestState
from common.engine.sequence import Sequence


def seq(rid, n, arrival=0, first=1):
    return Sequence(rid, list(range(first, first + n)), SamplingParams(max_tokens=100), arrival)


def advance(sched, bm, out, token=7):
    """Mark scheduled tokens computed; a sequence that reached its end gets a token."""
    for s in out.decode_seqs:
        s.num_computed_tokens += 1
    for s, n in zip(out.prefill_seqs, out.prefill_lens):
        s.num_computed_tokens += n
    for s in (*out.decode_seqs, *out.prefill_seqs):
        bm.cache_full_blocks(s)
        if s.num_computed_tokens == len(s):
            s.token_ids.append(token)


def plan(out):
    return ([s.request_id for s in out.decode_seqs],
            list(zip([s.request_id for s in out.prefill_seqs], out.prefill_lens)))


def test_chunked_prefill_respects_budget_and_puts_decodes_first():
    bm = BlockManager(64, 16)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=32)
    a, b = seq("a", 100), seq("b", 10, 1)
    sched.add(a)
    sched.add(b)
    steps = []
    for _ in range(6):
        out = sched.schedule()
        steps.append(plan(out))
        advance(sched, bm, out)
    assert steps == [
        ([], [("a", 32)]),
        ([], [("a", 32)]),
        ([], [("a", 32)]),
        ([], [("a", 4), ("b", 10)]),
        (["a", "b"], []),
        (["a", "b"], []),
    ]
    for s in (a, b):
        sched.finish(s, "length")
    assert bm.num_used_blocks == 0


def test_seat_limit_admits_in_fifo_order():
    bm = BlockManager(64, 16)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=1000)
    seqs = [seq(f"s{i}", 5, i) for i in range(3)]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert plan(out) == ([], [("s0", 5), ("s1", 5)])
    advance(sched, bm, out)
    sched.finish(seqs[0], "stop")
    out = sched.schedule()
    assert plan(out) == (["s1"], [("s2", 5)])
    for s in seqs[1:]:
        sched.finish(s, "stop")
    assert bm.num_used_blocks == 0


def test_preemption_frees_newest_and_recomputes_it_later():
    bm = BlockManager(4, 4)               # 16 token slots
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = seq("a", 8), seq("b", 8, 1, first=50)  # 2 blocks each: the cache is full
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert plan(out) == ([], [("a", 8), ("b", 8)])
    advance(sched, bm, out)               # both now hold 9 tokens: each needs a 3rd block
    out = sched.schedule()
    assert out.preempted == [b]
    assert plan(out) == (["a"], [])
    assert b.state == RequestState.WAITING and b.block_ids == [] and b.num_computed_tokens == 0
    assert a.block_ids == [0, 1, 3]       # b's blocks were freed tail first: 3 then 2
    advance(sched, bm, out)
    sched.finish(a, "length")
    out = sched.schedule()                # b is recomputed: prompt + its generated token,
    assert plan(out) == ([], [("b", 5)])  # less its first block, still in the prefix cache
    assert b.block_ids[0] == 2
    assert b.num_preemptions == 1
    sched.finish(b, "length")
    assert bm.num_used_blocks == 0


def test_prefix_hits_are_counted_once_at_first_admission():
    bm = BlockManager(16, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    a = seq("a", 9)
    sched.add(a)
    advance(sched, bm, sched.schedule())
    sched.finish(a, "stop")
    b = seq("b", 9, 1)
    sched.add(b)
    out = sched.schedule()
    assert plan(out) == ([], [("b", 1)]) or plan(out) == (["b"], [])
    assert b.num_cached_tokens == 8
    sched.finish(b, "stop")
    assert bm.num_used_blocks == 0
