"""KV writes (and reads) that a tensor-parallel worker makes with its own KV cache, on rank
0's order.

A rank's KV heads live only in its own process, registered with its own transfer engine
(worker.py), so a prefill node at TP > 1 pushes each rank's share from that rank. What to
write and when stays with rank 0 (services/prefill/kv_push.py decides blocks, layers,
deadlines and stops for every rank alike); a worker only executes:

    rank 0 (an executor thread of the node)         worker r (its `rank-writes` thread)
    RankWriters.write(r, order) -> Future   --pipe-->  serve_writes: order on a pool thread
                                                       KVSender.send_blocks(own cache, ...)
    Future resolves (bytes, or TransferError) <--pipe--  (order id, bytes | error, unsettled)

Ordering: rank 0 orders a layer's write only after its forward pass finished that layer,
which ends in an all-reduce every rank joined after writing the layer's KV (the row-
parallel output projection), so the worker's bytes are in place when its order arrives.

Reads (ReadOrder: KVSender.fetch_blocks into the worker's own blocks) are how a worker
loads its heads of a prefix from the kv-store (services/prefill/store_prefix.py). They go
the same way, with the same deadlines; a read given up on may still land in its blocks
(unsettled), which the caller then keeps quarantined.

Timeouts: an order carries `not_after`, the latest time it may start (its submission plus
its timeout_s, never past the request's deadline: the pusher caps timeout_s by what is
left); a worker that takes it later answers a settled failure without writing (time.
monotonic is one clock for every process of a host). Once started, its transfer call
ends within twice timeout_s (TimeoutConfig.transfer_s: it gives up at timeout_s and lets
what is in flight end within as long again). So rank 0 waits until not_after + 2 x
timeout_s for the answer, then fails the write as unsettled (it may still land). A
worker that exits fails every write it had not answered, unsettled too: bytes it sent
may still sit in the receiver's socket and be applied.

Thread-safety: RankWriters.write from any thread; one receiver thread per worker.
"""
from __future__ import annotations

import concurrent.futures
import itertools
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from common.transfer.base import TransferError
from common.kv_layout import KVLayout

log = logging.getLogger("pdmesh.engine")

WRITE_THREADS = 4      # as the node's own KV executor: writes of several requests at once


class _Deadlines:
    """An order starts by `not_after` or not at all; its transfer then ends within
    2 x `timeout_s` (the fields of the dataclasses below)."""

    @property
    def answer_by(self) -> float:
        """When rank 0 stops waiting for its answer (monotonic)."""
        return self.not_after + 2 * self.timeout_s


@dataclass(frozen=True)
class WriteOrder(_Deadlines):
    """One batched write of the worker's blocks into a peer rank (KVSender.send_blocks)."""

    peer: str
    dst_layout: KVLayout
    src_block_ids: tuple[int, ...]
    dst_block_ids: tuple[int, ...]
    layers: tuple[int, ...] | None
    last_block_tokens: int | None
    timeout_s: float
    head_offset: int | None
    not_after: float                # time.monotonic() past which it must not start

    def run(self, sender) -> int:
        return sender.send_blocks(self.peer, self.dst_layout, self.src_block_ids, self.dst_block_ids,
                                  layers=self.layers, last_block_tokens=self.last_block_tokens,
                                  timeout_s=self.timeout_s, head_offset=self.head_offset)


@dataclass(frozen=True)
class ReadOrder(_Deadlines):
    """One batched read of a peer's blocks into the worker's own (KVSender.fetch_blocks)."""

    peer: str
    src_layout: KVLayout
    src_block_ids: tuple[int, ...]
    dst_block_ids: tuple[int, ...]
    timeout_s: float
    not_after: float

    def run(self, sender) -> int:
        return sender.fetch_blocks(self.peer, self.src_layout, self.src_block_ids, self.dst_block_ids,
                                   timeout_s=self.timeout_s)


@dataclass(frozen=True)
class WeightsOrder(_Deadlines):
    """Register (or unregister) the worker's served weights with its transfer engine
    (common/runner/served_weights.RankPool), for a weight seed's lease (services/node/
    weight_seed.py). Moves no bytes."""

    register: bool
    timeout_s: float
    not_after: float

    def run(self, weights) -> int:
        if weights is None:
            raise ValueError("this rank keeps no weights to serve")
        weights.register() if self.register else weights.unregister()
        return 0


def serve_writes(conn, sender, sync=None, weights=None) -> None:
    """Worker: run each WriteOrder or ReadOrder received on `conn` with `sender` (this rank's KVSender),
    answering (order id, bytes, None) or (order id, 0, (message, unsettled)); returns when
    rank 0 says stop (None) or its end is gone, once the writes in flight ended. sync():
    on a device, waits for the rank's queued kernels (those that wrote the KV) first.
    weights: the rank's served weights (RankPool) for WeightsOrders, or None."""
    send_lock = threading.Lock()
    pool = ThreadPoolExecutor(WRITE_THREADS, thread_name_prefix="rank-write")
    # registrations in order, on a thread of their own: never queued behind KV writes
    # (an unregister must not miss its start deadline), never two at once
    registrar = ThreadPoolExecutor(1, thread_name_prefix="rank-weights")

    def register(order_id: int, order: WeightsOrder) -> None:
        try:   # no start deadline: a late unregister must still happen
            answer = (order_id, order.run(weights), None)
        except Exception as e:
            answer = (order_id, 0, (f"{type(e).__name__}: {e}", False))
        with send_lock:
            conn.send(answer)

    def run(order_id: int, order: WriteOrder) -> None:
        if time.monotonic() > order.not_after:
            answer = (order_id, 0, ("the transfer's start deadline passed while it waited; nothing moved", False))
            with send_lock:
                conn.send(answer)
            return
        try:
            if sync is not None:
                sync()
                if time.monotonic() > order.not_after:   # the wait outlasted the start deadline
                    raise ValueError("the transfer's start deadline passed while the device finished; "
                                     "nothing moved")
            answer = (order_id, order.run(sender), None)
        except TransferError as e:
            answer = (order_id, 0, (str(e), e.unsettled))
        except ValueError as e:   # a plan error: nothing moved
            answer = (order_id, 0, (str(e), False))
        except Exception as e:    # unknown: bytes may be in flight
            answer = (order_id, 0, (f"{type(e).__name__}: {e}", True))
        with send_lock:
            conn.send(answer)

    try:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                return
            if message is None:
                return
            (registrar.submit(register, *message) if isinstance(message[1], WeightsOrder)
             else pool.submit(run, *message))
    finally:
        pool.shutdown(wait=True)
        registrar.shutdown(wait=True)
        conn.close()


class WorkerSender:
    """KVSender's send_blocks and fetch_blocks as worker `rank` makes them with its own
    cache, for rank 0's callers (the kv-store client of that rank): each blocks the
    calling thread until the worker answered. As KVSender's, a call returns within
    2 x timeout_s: the order must start within timeout_s / 2 and its transfer gets
    timeout_s / 2 (it ends within twice that)."""

    def __init__(self, writers: "RankWriters", rank: int):
        self.writers, self.rank = writers, rank

    def _run(self, order: WriteOrder | ReadOrder) -> int:
        return self.writers.wait(self.writers.write(self.rank, order), order)

    def send_blocks(self, peer_endpoint: str, dst_layout: KVLayout, src_block_ids, dst_block_ids,
                    layers=None, last_block_tokens=None, timeout_s: float = 10.0, head_offset=None) -> int:
        half = timeout_s / 2
        return self._run(WriteOrder(peer_endpoint, dst_layout, tuple(src_block_ids), tuple(dst_block_ids),
                                    None if layers is None else tuple(layers), last_block_tokens, half,
                                    head_offset, time.monotonic() + half))

    def fetch_blocks(self, peer_endpoint: str, src_layout: KVLayout, src_block_ids, dst_block_ids,
                     timeout_s: float = 10.0) -> int:
        half = timeout_s / 2
        return self._run(ReadOrder(peer_endpoint, src_layout, tuple(src_block_ids), tuple(dst_block_ids),
                                   half, time.monotonic() + half))


class RankWriters:
    """Rank 0's side: one pipe per worker (rank 1 first)."""

    def __init__(self, conns: list):
        self._conns = conns
        self._send_locks = [threading.Lock() for _ in conns]
        self._pending: list[dict[int, Future]] = [{} for _ in conns]
        self._gone: list[str | None] = [None] * len(conns)
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._reads: set[int] = set()   # ids of the ReadOrders not answered yet
        self.bytes_written = 0      # acknowledged by the peers of every worker rank
        self.bytes_read = 0         # read into every worker rank's cache (ReadOrder)
        for i, conn in enumerate(conns):
            threading.Thread(target=self._receive, args=(i,), name=f"rank{i + 1}-writes", daemon=True).start()

    def write(self, rank: int, order: WriteOrder | ReadOrder) -> Future:
        """Worker `rank` (>= 1) runs `order`; the future gives the bytes written (or read),
        or raises TransferError. Wait for it with wait(future, order)."""
        i = rank - 1
        future: Future = Future()
        order_id = next(self._ids)
        with self._lock:
            if self._gone[i] is not None:
                future.set_exception(TransferError(self._gone[i]))
                return future
            self._pending[i][order_id] = future
            if isinstance(order, ReadOrder):
                self._reads.add(order_id)
        try:
            with self._send_locks[i]:
                self._conns[i].send((order_id, order))
        except (OSError, ValueError, TypeError) as e:   # TypeError: its end was just closed
            self._end(i, f"tensor-parallel rank {rank} cannot take KV writes: {e}")
        return future

    def wait(self, future: Future, order: WriteOrder | ReadOrder) -> int:
        """The bytes the order moved; TransferError when it failed or did not answer by
        order.answer_by (then unsettled: it may still land)."""
        try:
            return future.result(timeout=max(0.0, order.answer_by - time.monotonic()))
        except concurrent.futures.TimeoutError:   # not the builtin TimeoutError before 3.11
            what = "read" if isinstance(order, ReadOrder) else "write"
            raise TransferError(f"a tensor-parallel rank did not answer its KV {what} in time",
                                unsettled=True) from None

    def _receive(self, i: int) -> None:
        """The worker's answers, until its end closes (then this thread closes ours: a
        connection closed under a thread blocked reading it would not wake that thread)."""
        conn = self._conns[i]
        while True:
            try:
                order_id, nbytes, error = conn.recv()
            except (EOFError, OSError):
                self._end(i, f"tensor-parallel rank {i + 1} exited; its KV writes ended")
                with self._send_locks[i]:
                    conn.close()
                return
            with self._lock:
                future = self._pending[i].pop(order_id, None)
                if order_id in self._reads:
                    self._reads.discard(order_id)
                    self.bytes_read += nbytes
                else:
                    self.bytes_written += nbytes
            if future is None:
                continue
            if error is None:
                future.set_result(nbytes)
            else:
                future.set_exception(TransferError(f"rank {i + 1}: {error[0]}", unsettled=error[1]))

    def _end(self, i: int, why: str) -> None:
        """Worker i + 1 takes no more writes; fail those it did not answer (unsettled)."""
        with self._lock:
            self._gone[i] = self._gone[i] or why
            pending, self._pending[i] = self._pending[i], {}
            self._reads.difference_update(pending)
        for future in pending.values():
            if not future.done():
                future.set_exception(TransferError(why, unsettled=True))

    def close(self) -> None:
        """No more writes; a live worker is told to stop taking them (its end then closes,
        and so, on the receiver thread, ours)."""
        for i, conn in enumerate(self._conns):
            self._end(i, "the tensor-parallel engine is closed")
            try:
                with self._send_locks[i]:
                    conn.send(None)
            except (OSError, ValueError, TypeError):   # the worker is gone already
                pass
