"""Frozen configuration dataclasses. Lower layers take plain arguments; services compose
these. Nothing here mutates at run time."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("cpu", "cuda", "npu")
KERNEL_BACKENDS = ("auto", "ref", "npu", "cuda")


@dataclass(frozen=True)
class EngineConfig:
    """One inference engine. Zero means "derive": block_size from the kernel backend
    (16 on ref/cuda, 128 on npu), num_blocks from kv_cache_memory, max_model_len from the
    model's max_position_embeddings and the cache size."""

    model: str
    model_id: str = ""
    dtype: str = "auto"
    device: str = "cpu"
    kernel_backend: str = "auto"
    block_size: int = 0
    num_blocks: int = 0
    kv_cache_memory: int = 1 << 30
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 0
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    seed: int = 0
    num_threads: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.device.split(":")[0] not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES} (optionally with :index), got {self.device!r}")
        if self.kernel_backend not in KERNEL_BACKENDS:
            raise ValueError(f"kernel_backend must be one of {KERNEL_BACKENDS}, got {self.kernel_backend!r}")
        for name in ("block_size", "num_blocks", "max_model_len", "num_threads"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0 = derive), got {getattr(self, name)}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "kv_cache_memory"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> "EngineConfig":
        """vLLM-style engine args; an unknown name is a ValueError listing the known ones."""
        known = {f.name for f in dataclasses.fields(cls)} - {"model"}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine argument(s) {unknown}; allowed: {sorted(known)}")
        return cls(model=str(model), **kwargs)
