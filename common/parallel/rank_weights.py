"""Rank 0's handle on a tensor-parallel worker's served weights: the same interface as
common/runner/served_weights.RankPool (register, unregister, registered, nbytes,
to_proto), carried out by the worker on rank 0's order (rank_writes.WeightsOrder), so that
a weight seed registers every rank's weights only while a loader holds a lease."""
from __future__ import annotations

import time

from common.parallel.rank_writes import RankWriters, WeightsOrder

ORDER_S = 10.0     # a worker answers a registration order within this (it moves no bytes)


class WorkerRankPool:
    def __init__(self, rank: int, writers: RankWriters, info):
        """info: the worker's RankWeights (weights_pb2; store key weights/<rank>)."""
        self.rank, self.writers, self.info = rank, writers, info
        self.registered = False

    @property
    def nbytes(self) -> int:
        return self.info.manifest.total_bytes

    def _order(self, register: bool) -> None:
        order = WeightsOrder(register, ORDER_S, time.monotonic() + ORDER_S)
        self.writers.wait(self.writers.write(self.rank, order), order)

    def register(self) -> None:
        self.registered = True      # first: a registration that fails or times out is undone too
        self._order(True)

    def unregister(self) -> None:
        """Always sent (the worker's side is idempotent); registered clears only once the
        worker confirmed, so a failed unregister is tried again at the next one."""
        self._order(False)
        self.registered = False

    def to_proto(self):
        return self.info
