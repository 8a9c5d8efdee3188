"""Transfer backends by name, imported only when asked for, so that a host without
Mooncake (or grpc) can still import everything else."""
from __future__ import annotations

import importlib

from common.transfer.base import TransferEngine

BACKENDS = {
    "mooncake": ("common.transfer.mooncake", "MooncakeTransfer"),
    "grpc": ("common.transfer.grpc_transfer", "GrpcTransfer"),
    "fake": ("common.transfer.fake", "FakeTransfer"),
}


def create_transfer(backend: str, **options) -> TransferEngine:
    """A new engine of the named backend, constructed with `options` (its ctor keywords).
    ValueError for an unknown name; RuntimeError if the backend's package is missing."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown transfer backend {backend!r}; allowed: {', '.join(BACKENDS)}")
    module, cls = BACKENDS[backend]
    return getattr(importlib.import_module(module), cls)(**options)
