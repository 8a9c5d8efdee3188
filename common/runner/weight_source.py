"""Where a rank's weights come from: the checkpoint on the disk, or (services/node/
weight_loader.py) a live peer's memory. load_rank asks its WeightSource to fill a freshly
built model's parameters, on the CPU and in the checkpoint's form, before the model moves
to its device and its linears are prepared.

    loaded = source.fill(model, identity, keep_pool)
    loaded.source       "disk" or "peer"
    loaded.pool         the weights as one registered-able buffer (keep_pool: the rank
                        will serve them as a weight seed), else None
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from common.model.weight_pool import BUCKET_BYTES, WeightPool


@dataclass
class LoadedWeights:
    source: str                   # "disk" | "peer"
    seconds: float
    nbytes: int                   # the parameters' bytes
    pool: WeightPool | None = None
    seed: str = ""                # the peer read from
    tried: list[str] = field(default_factory=list)   # seeds that failed first, with why


class WeightSource(Protocol):
    def fill(self, model: torch.nn.Module, identity: str, keep_pool: bool) -> LoadedWeights:
        """Fill model's parameters; ValueError naming the problem when it cannot."""
        ...


def parameter_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


class DiskWeights:
    """The checkpoint folder or .gguf file (model.load_weights)."""

    def __init__(self, model_dir: str | Path, bucket_bytes: int = BUCKET_BYTES):
        self.model_dir, self.bucket_bytes = model_dir, bucket_bytes

    def fill(self, model: torch.nn.Module, identity: str = "", keep_pool: bool = False) -> LoadedWeights:
        start = time.perf_counter()
        model.load_weights(self.model_dir)
        pool = WeightPool.of_model(model, self.bucket_bytes) if keep_pool else None
        return LoadedWeights("disk", time.perf_counter() - start, parameter_bytes(model), pool)
