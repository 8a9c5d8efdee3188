"""Rank 0's KV write orders to a tensor-parallel worker (common/parallel/rank_writes.py),
over a real pipe with the worker's loop on a thread, and the sharded destination writes
(services/prefill/kv_destination.py) that wait for every rank."""
from __future__ import annotations

import multiprocessing
import threading
import time

import pytest
import torch

from common.parallel.rank_writes import RankWriters, WriteOrder, serve_writes
from common.transfer.base import TransferError
from common.transfer.layout import KVLayout
from services.prefill.kv_destination import RankPairWrites, RankTarget, destination_writes, rank_targets


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
