"""One rank's weights as a weight seed serves them: its pool (common/model/weight_pool.py),
registered with the rank's transfer engine only on demand (services/node/weight_seed.py
orders it while a loader holds a lease; at tensor parallelism rank 0 orders the other
ranks through common/parallel/rank_writes.WeightsOrder)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from common.model.weight_pool import WeightPool


@dataclass
class RankPool:
    """register() / unregister(): from any one thread at a time (the seed's lock)."""
    rank: int
    transfer: Any            # the rank's TransferEngine
    pool: WeightPool
    region: Any = None       # the Region while registered

    def register(self) -> None:
        if self.region is None:
            self.region = self.transfer.register(self.pool.address, self.pool.nbytes)

    def unregister(self) -> None:
        region, self.region = self.region, None
        if region is not None:
            self.transfer.unregister(region)

    @property
    def registered(self) -> bool:
        return self.region is not None

    @property
    def nbytes(self) -> int:
        return self.pool.nbytes

    def to_proto(self):
        from protos.pdmesh.v1 import weights_pb2
        return weights_pb2.RankWeights(rank=self.rank, transfer_endpoint=self.transfer.endpoint,
                                       base_address=self.pool.address, manifest=self.pool.manifest.to_proto())
