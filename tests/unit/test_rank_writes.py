"""Rank 0's KV write orders to a tensor-parallel worker (common/parallel/rank_writes.py),
over a real pipe with the worker's loop on a thread, and the sharded destination writes
(services/prefill/kv_destination.py): waiting for every rank, and staging head slices
into whole blocks."""
from __future__ import annotations

import multiprocessing
import threading
import time

import pytest
import torch

from common.parallel.rank_writes import RankWriters, ReadOrder, WorkerSender, WriteOrder, serve_writes
from common.transfer.base import TransferError
from common.transfer.fake import FakeTransfer
from common.transfer.kv_writes import KVSender
from common.kv_layout import KVLayout
from services.prefill.kv_destination import (RankPairWrites, RankTarget, Staged, StagedWrites, Staging, StagingPool,
                                             destination_writes, rank_targets)


CACHES = {heads: torch.zeros(2, 2, 8, 4, heads, 3) for heads in (2, 4)}


def layout(heads: int) -> KVLayout:
    return KVLayout.of_tensor(CACHES[heads])


class Sender:
    """A worker's KVSender stand-in: records the orders, answers bytes, or fails."""

    def __init__(self, fail: TransferError | None = None, block: threading.Event | None = None):
        self.calls, self.fail, self.block = [], fail, block

    def send_blocks(self, peer, dst_layout, src, dst, layers=None, last_block_tokens=None, timeout_s=None,
                    head_offset=None):
        if self.block is not None:
            self.block.wait()
        self.calls.append((peer, tuple(src), tuple(dst), layers, last_block_tokens, head_offset))
        if self.fail is not None:
            raise self.fail
        return 100 * len(src)


def worker(sender) -> tuple[RankWriters, threading.Thread, object]:
    ours, theirs = multiprocessing.Pipe()
    thread = threading.Thread(target=serve_writes, args=(theirs, sender), daemon=True)
    thread.start()
    return RankWriters([ours]), thread, theirs


def order(**kw) -> WriteOrder:
    timeout_s = kw.pop("timeout_s", 1.0)
    return WriteOrder(**{"peer": "d:1", "dst_layout": layout(4), "src_block_ids": (1, 2), "dst_block_ids": (5, 6),
                         "layers": (0,), "last_block_tokens": None, "timeout_s": timeout_s, "head_offset": 2,
                         "not_after": time.monotonic() + timeout_s, **kw})


def test_a_worker_runs_the_order_and_answers_its_bytes():
    sender = Sender()
    writers, thread, _ = worker(sender)
    o = order()
    assert writers.wait(writers.write(1, o), o) == 200
    assert sender.calls == [("d:1", (1, 2), (5, 6), (0,), None, 2)]
    writers.close()
    thread.join(5)
    assert not thread.is_alive(), "the worker's loop ends when rank 0 closes its end"


def test_a_failed_write_comes_back_as_a_transfer_error_with_its_settledness():
    writers, _, _ = worker(Sender(fail=TransferError("peer refused", unsettled=True)))
    o = order()
    with pytest.raises(TransferError, match="rank 1: peer refused") as e:
        writers.wait(writers.write(1, o), o)
    assert e.value.unsettled
    writers.close()


class StuckSender:
    def send_blocks(self, *args, **kwargs):
        threading.Event().wait()


def test_a_worker_that_goes_away_fails_what_it_had_not_answered_as_unsettled():
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=serve_writes, args=(theirs, StuckSender()), daemon=True)
    proc.start()
    theirs.close()
    writers = RankWriters([ours])
    o = order()
    future = writers.write(1, o)
    proc.kill()
    proc.join(10)
    with pytest.raises(TransferError, match="rank 1 exited") as e:
        writers.wait(future, o)
    assert e.value.unsettled
    with pytest.raises(TransferError, match="rank 1 exited"):
        writers.wait(writers.write(1, o), o)    # refused at once from now on
    writers.close()


def test_no_answer_within_twice_the_timeout_is_an_unsettled_failure():
    block = threading.Event()
    writers, _, _ = worker(Sender(block=block))
    o = order(timeout_s=0.05)
    with pytest.raises(TransferError, match="did not answer") as e:
        writers.wait(writers.write(1, o), o)
    assert e.value.unsettled
    block.set()
    writers.close()


def test_an_order_taken_past_its_start_deadline_writes_nothing_and_is_settled():
    sender = Sender()
    writers, _, _ = worker(sender)
    o = order(not_after=time.monotonic() - 0.01)
    with pytest.raises(TransferError, match="start deadline passed") as e:
        writers.wait(writers.write(1, o), o)
    assert not e.value.unsettled and sender.calls == []
    writers.close()


def test_a_sharded_write_returns_only_once_the_worker_answered():
    release = threading.Event()
    writers, _, _ = worker(Sender(block=release))
    writes = RankPairWrites(Sender(), writers, rank_targets([layout(2), layout(2)], [("a", layout(4))]))
    done = []
    t = threading.Thread(target=lambda: done.append(writes.write([1], [3], None, None, 5.0)))
    t.start()
    t.join(0.3)
    assert t.is_alive() and not done, "rank 0's own write is done; the worker's is not"
    release.set()
    t.join(5)
    assert done == [200]
    writers.close()


def test_rank_targets_pair_each_prefill_rank_with_the_decode_rank_of_its_heads():
    assert rank_targets([layout(2), layout(2)], [("a", layout(2)), ("b", layout(2))]) == [
        RankTarget(0, "a", layout(2), None), RankTarget(1, "b", layout(2), None)]
    assert rank_targets([layout(2), layout(2)], [("a", layout(4))]) == [
        RankTarget(0, "a", layout(4), 0), RankTarget(1, "a", layout(4), 2)]
    with pytest.raises(ValueError, match="prefill TP 1 < decode TP 2"):
        rank_targets([layout(4)], [("a", layout(2)), ("b", layout(2))])
    with pytest.raises(ValueError, match=r"head_dim 3 != 5"):
        destination_writes(Sender(), None, [layout(2), layout(2)],
                           [("a", KVLayout.of_tensor(torch.zeros(2, 2, 8, 4, 4, 5)))])


LATENT = KVLayout.of_tensor(torch.zeros(2, 1, 8, 4, 1, 6))


@pytest.mark.parametrize("p,d,pairs", [(1, 1, [(0, 0)]), (2, 1, [(0, 0)]), (1, 2, [(0, 0), (0, 1)]),
                                       (2, 2, [(0, 0), (1, 1)]), (2, 4, [(0, 0), (1, 1), (0, 2), (1, 3)])])
def test_a_latent_cache_pairs_any_prefill_tp_with_any_decode_tp(p, d, pairs):
    """MLA: every rank holds the same latent, so decode rank j gets its whole copy from
    prefill rank j % p (never head slices, never staged)."""
    dest = [(f"d:{j}", LATENT) for j in range(d)]
    targets = rank_targets([LATENT] * p, dest)
    assert [(t.src, int(t.peer[2:])) for t in targets] == pairs
    assert all(t.head_offset is None for t in targets)
    staging = Staging(pool=None, gather=None, sender_for=None)
    writes = destination_writes(Sender(), RankWriters([]) if p > 1 else None, [LATENT] * p, dest, staging)
    assert isinstance(writes, RankPairWrites) if (p, d) != (1, 1) else not isinstance(writes, StagedWrites)
    with pytest.raises(ValueError, match="incompatible KV layouts.*kind 'latent' != 'kv'"):
        destination_writes(Sender(), None, [LATENT, LATENT], [("a", layout(2))])


def test_a_sharded_write_waits_for_every_rank_and_raises_once_all_ended():
    rank0 = Sender(fail=TransferError("rank 0 peer down"))
    writers, _, _ = worker(Sender())
    writes = RankPairWrites(rank0, writers, rank_targets([layout(2), layout(2)], [("a", layout(4))]))
    with pytest.raises(TransferError, match="rank 0 peer down") as e:
        writes.write([1], [3], None, 4, 1.0)
    assert not e.value.unsettled
    ok = RankPairWrites(Sender(), writers, rank_targets([layout(2), layout(2)], [("a", layout(4))]))
    assert ok.write([1, 2], [3, 4], (1,), None, 1.0) == 400     # both ranks' bytes
    writers.close()


def staged_fixture(pool_blocks: int):
    """Two prefill ranks of 2 heads (random KV); a 4-head destination cache (-1) and a
    2-rank destination of 2 heads each (-1), each in its own fake transfer; a staging pool
    of pool_blocks blocks registered with the sender's."""
    gen = torch.Generator().manual_seed(0)
    ranks = [torch.randn(2, 2, 8, 4, 2, 3, generator=gen) for _ in range(2)]
    src_t = FakeTransfer()
    dests = {"d1": [torch.full((2, 2, 8, 4, 4, 3), -1.0)],
             "d2": [torch.full((2, 2, 8, 4, 2, 3), -1.0) for _ in range(2)]}
    endpoints = {}
    for name, caches in dests.items():
        endpoints[name] = []
        for cache in caches:
            t = FakeTransfer()
            t.register(cache.data_ptr(), cache.numel() * cache.element_size())
            endpoints[name].append((t.endpoint, KVLayout.of_tensor(cache)))
    buffer = torch.zeros(pool_blocks * 2 * 2 * 4 * 4 * 3)
    src_t.register(buffer.data_ptr(), buffer.numel() * buffer.element_size())
    pool = StagingPool(buffer, num_layers=2, num_blocks=pool_blocks, block_size=4, num_heads=4, head_dim=3)
    staging = Staging(pool, gather=lambda ids: [r[:, :, ids] for r in ranks],
                      sender_for=lambda cache: KVSender(src_t, KVLayout.of_tensor(cache)))
    return ranks, dests, endpoints, pool, staging, src_t


class Slices:
    """The head-slice fallback, recorded."""

    def __init__(self):
        self.calls = []

    def write(self, src, dst, layers, last, timeout_s):
        self.calls.append((tuple(src), tuple(dst), last))
        return 7


def test_staged_writes_assemble_every_rank_s_heads_into_whole_blocks_of_the_decode_rank():
    """Prefill TP 2 -> decode TP 1: rank 0 gathers both ranks' 2 heads of the batch into
    staging blocks and pushes them whole (one write per layer and K/V); the decode cache's
    blocks equal both ranks' caches side by side, the partial last block only up to its
    tokens."""
    ranks, dests, endpoints, pool, staging, src_t = staged_fixture(3)
    writes = StagedWrites(staging, Slices(), endpoints["d1"], k=2)
    sends = []
    real = src_t.write
    src_t.write = lambda peer, batch, timeout_s=None: sends.append(len(batch)) or real(peer, batch, timeout_s)
    batch = writes.stage([5, 6])
    assert batch == Staged(((0, 2),), ())
    assert writes.write(batch, [1, 2], None, 3, 1.0) == (4 + 3) * 4 * 3 * 4 * 2 * 2
    assert sends == [4], "one write per layer and K/V (one run of 2 blocks)"
    [dest] = dests["d1"]
    want = torch.cat(ranks, dim=4)
    assert torch.equal(dest[:, :, 1], want[:, :, 5])
    assert torch.equal(dest[:, :, 2, :3], want[:, :, 6, :3])
    assert (dest[:, :, 2, 3] == -1).all(), "the partial last block's other slots untouched"
    assert (dest[:, :, [0, 3, 4, 5, 6, 7]] == -1).all()
    assert pool.take(3) == (0, 3), "the staging blocks came back once the write ended"
    assert pool.num_staged == 2


def test_batches_for_decode_nodes_of_different_tp_sizes_never_share_staging_bytes():
    """A TP 1 and a TP 2 destination staged at once (before either is written) each get
    exactly their heads: d2's rank 0 heads 0-1, rank 1 heads 2-3."""
    ranks, dests, endpoints, pool, staging, _ = staged_fixture(4)
    to_d1 = StagedWrites(staging, Slices(), endpoints["d1"], k=2)
    to_d2 = StagedWrites(staging, Slices(), endpoints["d2"], k=1)
    a, b = to_d1.stage([0, 1]), to_d2.stage([2, 3])
    assert a.runs == ((0, 2),) and b.runs == ((2, 2),)
    to_d1.write(a, [4, 5], None, None, 1.0)
    to_d2.write(b, [6, 7], None, None, 1.0)
    want = torch.cat(ranks, dim=4)
    assert torch.equal(dests["d1"][0][:, :, [4, 5]], want[:, :, [0, 1]])
    assert torch.equal(dests["d2"][0][:, :, [6, 7]], ranks[0][:, :, [2, 3]])
    assert torch.equal(dests["d2"][1][:, :, [6, 7]], ranks[1][:, :, [2, 3]])


def test_what_the_pool_has_no_room_for_goes_as_head_slices_and_unsettled_runs_come_back_later():
    ranks, dests, endpoints, pool, staging, src_t = staged_fixture(2)
    slices = Slices()
    writes = StagedWrites(staging, slices, endpoints["d1"], k=2)
    batch = writes.stage([1, 2, 3])
    assert batch == Staged(((0, 2),), (3,)) and pool.num_unstaged == 1
    assert writes.write(batch, [4, 5, 6], None, 2, 1.0) == 2 * 4 * 4 * 3 * 4 * 2 * 2 + 7
    assert slices.calls == [((3,), (6,), 2)], "the rest, with the partial last block's token count"
    want = torch.cat(ranks, dim=4)
    assert torch.equal(dests["d1"][0][:, :, [4, 5]], want[:, :, [1, 2]])

    def unsettled(*args, **kwargs):
        raise TransferError("peer stalled", unsettled=True)

    src_t.write = unsettled
    batch = writes.stage([1])
    with pytest.raises(TransferError, match="peer stalled") as e:
        writes.write(batch, [0], None, None, 0.05)
    assert e.value.unsettled
    assert pool.take(2) == (1, 1), "the unsettled run is held back for twice the timeout"
    time.sleep(0.3)
    assert pool.take(1) == (0, 1), "then given back"


def test_a_worker_sender_reads_and_writes_the_workers_own_cache():
    """WorkerSender (a kv-store client's sender for a worker rank): a read lands in the
    worker's blocks and counts in bytes_read, a write comes from them and counts in
    bytes_written; both exact."""
    own, store = torch.zeros(2, 2, 8, 4, 2, 3), torch.arange(2 * 2 * 6 * 4 * 2 * 3, dtype=torch.float32).reshape(2, 2, 6, 4, 2, 3)
    own_t, store_t = FakeTransfer(), FakeTransfer()
    own_t.register(own.data_ptr(), own.numel() * own.element_size())
    store_t.register(store.data_ptr(), store.numel() * store.element_size())
    writers, thread, _ = worker(KVSender(own_t, KVLayout.of_tensor(own)))
    sender = WorkerSender(writers, 1)
    block_bytes = 2 * 2 * 4 * 2 * 3 * 4                 # layers x K/V x a block's rows, fp32
    assert sender.fetch_blocks(store_t.endpoint, KVLayout.of_tensor(store), [4, 5], [1, 2], timeout_s=2.0) == 2 * block_bytes
    assert torch.equal(own[:, :, 1:3], store[:, :, 4:6]) and not own[:, :, 0].any() and not own[:, :, 3:].any()
    assert (writers.bytes_read, writers.bytes_written) == (2 * block_bytes, 0)
    own[:, :, 7] = 9.0
    assert sender.send_blocks(store_t.endpoint, KVLayout.of_tensor(store), [7], [0], timeout_s=2.0) == block_bytes
    assert torch.equal(store[:, :, 0], own[:, :, 7])
    assert (writers.bytes_read, writers.bytes_written) == (2 * block_bytes, block_bytes)
    writers.close()
    thread.join(5)
    own_t.close()
    store_t.close()


def test_a_worker_read_past_its_start_deadline_moves_nothing():
    own, store = torch.zeros(2, 2, 8, 4, 2, 3), torch.ones(2, 2, 6, 4, 2, 3)
    own_t, store_t = FakeTransfer(), FakeTransfer()
    own_t.register(own.data_ptr(), own.numel() * own.element_size())
    store_t.register(store.data_ptr(), store.numel() * store.element_size())
    writers, _, _ = worker(KVSender(own_t, KVLayout.of_tensor(own)))
    late = ReadOrder(store_t.endpoint, KVLayout.of_tensor(store), (0,), (0,), 1.0, time.monotonic() - 0.1)
    with pytest.raises(TransferError, match="start deadline passed") as e:
        writers.wait(writers.write(1, late), late)
    assert not e.value.unsettled and not own.any() and writers.bytes_read == 0
    writers.close()
    own_t.close()
    store_t.close()


class Weights:
    """A worker's served weights stand-in (common/runner/served_weights.RankPool)."""

    def __init__(self):
        self.calls = []

    def register(self):
        self.calls.append("register")

    def unregister(self):
        self.calls.append("unregister")


def test_weight_registration_orders_are_answered_while_every_write_thread_is_busy():
    from common.parallel.rank_weights import WorkerRankPool
    from common.parallel.rank_writes import WRITE_THREADS
    release, weights = threading.Event(), Weights()
    ours, theirs = multiprocessing.Pipe()
    threading.Thread(target=serve_writes, args=(theirs, Sender(block=release), None, weights), daemon=True).start()
    writers = RankWriters([ours])
    busy = [writers.write(1, order(timeout_s=30.0)) for _ in range(WRITE_THREADS + 2)]   # every write thread held
    served = WorkerRankPool(1, writers, info=None)
    try:
        served.register()           # answered though no write thread is free (a late unregister would leave
        assert served.registered    # the weights exposed)
        served.unregister()
        assert (served.registered, weights.calls) == (False, ["register", "unregister"])
    finally:
        release.set()
    assert [f.result(timeout=10) for f in busy] == [200] * len(busy)
    writers.close()
