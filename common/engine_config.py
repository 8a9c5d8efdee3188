"""The configuration of one inference engine (section `engine:` of a mesh config, and
LLM(...)'s keyword arguments). common.config re-exports it."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from common.cpu_budget import check_cpu_cores, format_cpu_list, parse_cpu_list

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("cpu", "cuda", "npu")
KERNEL_BACKENDS = ("auto", "ref", "cpu", "npu", "cuda")
W8A8_MIX_PATHS = ("auto", "static", "dynamic")
LM_HEAD_QUANTIZATIONS = ("none", "int8")    # common/model/layers/int8_vocab.py
MOE_DISPATCHES = ("all_reduce", "all_to_all")    # common/model/layers/moe_dispatch.py
LOAD_FORMATS = ("auto", "disk", "peer")    # services/node/weight_loader.py


@dataclass(frozen=True)
class EngineConfig:
    """One inference engine. Zero means "derive": block_size from the kernel backend
    (16 on ref/cpu/cuda, 128 on npu), num_blocks from kv_cache_memory, max_model_len from the
    model's max_position_embeddings and the cache size.

    cpu_cores pins the engine's process to those cores (ids, or "0-3,6" / [0, 1] in YAML,
    normalized to a sorted tuple); () = not pinned. num_threads 0 = one thread per core of
    cpu_cores, or torch's default when not pinned (common/cpu_budget.py).

    tensor_parallel_size N > 1 shards the model over N rank processes stepping together
    (common/parallel/executor.py); the model's heads must divide by N (checked when the
    engine loads it). num_threads and kv_cache_memory are then per rank, cpu_cores split
    N ways (when it has N cores or more); num_threads 0 = the cores split N ways.

    borrow_cores: cores of the prefill node beside a decode node (same forms; outside the
    cores the engine runs on: cpu_cores, or those it was started on), on which its steps
    add one thread each while none of its requests is prefilled remotely
    (common/engine/borrowed_cores.py; `pdmesh up` sets it); () = none. Needs
    tensor_parallel_size 1; used on device cpu only.

    w8a8_mix_path: which half of an msModelSlim W8A8_MIX checkpoint the engine runs:
    "static" (calibrated activation scales: cheaper steps) or "dynamic" (per-token scales:
    more accurate prefill); "auto" = static on a decode node of a mesh, dynamic elsewhere
    (vLLM-Ascend's rule: the KV consumer runs static). Other checkpoints ignore it.

    lm_head_quantization: "int8" quantizes the LM head's matrix at load, per vocab row, and
    runs the head as W8A8 dynamic; a tied embedding looks up the same codes (one int8 matrix
    instead of a float one: SmolLM2's head is a fifth of its weights and of a decode step's
    reads). It changes the logits (bench/quantize_accuracy.py measures it) and, when tied,
    the embeddings, so every node of a mesh takes it from the one engine section (a node's
    own engine section may not set it; common/config.py). "none":
    the head as the checkpoint has it.

    enable_expert_parallel (vLLM's name): a Mixture-of-Experts model at
    tensor_parallel_size N places its experts whole, E/N on each rank (attention stays
    tensor-parallel, the router is on every rank); without it every expert is split by
    columns over the ranks. Dense models ignore it.

    moe_dispatch: how an expert-parallel layer's tokens reach the ranks holding their
    experts (common/model/layers/moe_dispatch.py): "all_reduce" (every rank routes every
    token; one all-reduce sums the shares; the faster at data parallel 1, the default) or
    "all_to_all" (each rank routes a chunk and sends rows by counts: DeepEP's shape). Needs
    enable_expert_parallel to mean anything; without it all_to_all is refused.

    load_format: where a node's weights come from (docs/elastic.md). "auto": a live node of
    the same model identity and sharding (a weight seed) when the mesh has one, read
    one-sided and checked bucket by bucket, else the next seed, else the disk; "peer": a
    seed or a clear error (never the disk); "disk": the checkpoint. An engine outside a mesh
    (LLM) reads the disk whatever it says.

    weight_seed: once loaded, serve the weights to starting nodes (at most
    max_weight_clients at a time; a node keeps serving requests meanwhile). Costs one host
    copy of the rank's weights in the checkpoint's form where the backend keeps its own
    (CPU float weights: the oneDNN-packed copy is the other); registered with the transfer
    engine only while an admitted loader reads them. weight_bucket_bytes: the unit a seed's
    weights are checksummed and read in (a loader follows the seed's)."""

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
    cpu_cores: tuple[int, ...] = ()
    tensor_parallel_size: int = 1
    borrow_cores: tuple[int, ...] = ()
    w8a8_mix_path: str = "auto"
    lm_head_quantization: str = "none"
    enable_expert_parallel: bool = False
    moe_dispatch: str = "all_reduce"
    load_format: str = "auto"
    weight_seed: bool = True
    max_weight_clients: int = 2
    weight_bucket_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.device.split(":")[0] not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES} (optionally with :index), got {self.device!r}")
        if self.kernel_backend not in KERNEL_BACKENDS:
            raise ValueError(f"kernel_backend must be one of {KERNEL_BACKENDS}, got {self.kernel_backend!r}")
        if self.w8a8_mix_path not in W8A8_MIX_PATHS:
            raise ValueError(f"w8a8_mix_path must be one of {W8A8_MIX_PATHS}, got {self.w8a8_mix_path!r}")
        if self.lm_head_quantization not in LM_HEAD_QUANTIZATIONS:
            raise ValueError(f"lm_head_quantization must be one of {LM_HEAD_QUANTIZATIONS}, "
                             f"got {self.lm_head_quantization!r}")
        if self.moe_dispatch not in MOE_DISPATCHES:
            raise ValueError(f"moe_dispatch must be one of {MOE_DISPATCHES}, got {self.moe_dispatch!r}")
        if self.moe_dispatch == "all_to_all" and not self.enable_expert_parallel:
            raise ValueError("moe_dispatch: all_to_all needs enable_expert_parallel: true (experts split by "
                             "columns are summed by the all-reduce); allowed without it: all_reduce")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if not isinstance(self.max_weight_clients, int) or self.max_weight_clients < 1:
            raise ValueError(f"max_weight_clients must be an integer >= 1, got {self.max_weight_clients!r}")
        if not isinstance(self.weight_bucket_bytes, int) or self.weight_bucket_bytes < 4096:
            raise ValueError(f"weight_bucket_bytes must be an integer >= 4096, got {self.weight_bucket_bytes!r}")
        for name in ("block_size", "num_blocks", "max_model_len", "num_threads"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0 = derive), got {getattr(self, name)}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "kv_cache_memory"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        object.__setattr__(self, "cpu_cores", parse_cpu_list(self.cpu_cores))   # "0-3,6" -> (0, 1, 2, 3, 6)
        check_cpu_cores(self.cpu_cores)
        object.__setattr__(self, "borrow_cores", parse_cpu_list(self.borrow_cores, "borrow_cores"))
        if self.borrow_cores:
            host = os.cpu_count() or 1
            if tp > 1:
                raise ValueError(f"borrow_cores needs tensor_parallel_size 1, got {tp}")
            if max(self.borrow_cores) >= host or set(self.cpu_cores) & set(self.borrow_cores):
                raise ValueError(f"borrow_cores must be cores of this host ({format_cpu_list(range(host))}) "
                                 f"outside cpu_cores ({format_cpu_list(self.cpu_cores) or 'none'}), "
                                 f"got {format_cpu_list(self.borrow_cores)}")

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> "EngineConfig":
        """vLLM-style engine args; an unknown name is a ValueError listing the known ones."""
        known = {f.name for f in dataclasses.fields(cls)} - {"model"}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine argument(s) {unknown}; allowed: {sorted(known)}")
        return cls(model=str(model), **kwargs)


def resolved_w8a8_mix_path(config: EngineConfig) -> str:
    """"static" or "dynamic": config's choice, "auto" being dynamic outside a mesh's decode node."""
    return "dynamic" if config.w8a8_mix_path == "auto" else config.w8a8_mix_path
