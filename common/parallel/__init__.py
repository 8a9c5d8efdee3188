"""Tensor parallelism inside one engine (DESIGN.md "Tensor parallelism (per node)").

    shard.py        which heads / columns / vocab rows a rank holds; the size check
    group.py        a rank's collectives (gloo on cpu, nccl on cuda, hccl on npu)
    step_wire.py    the broadcast form of a step's inputs (common/runner/step_inputs.py)
    executor.py     rank 0's side: spawns the workers, sends each step, detects failure
    worker.py       ranks 1..N-1: load a shard, step in lockstep with rank 0
    rank_writes.py  KV writes a worker makes from its own cache, on rank 0's order

Modules here import torch lazily where they can, so config code may import shard.py.
"""
from __future__ import annotations

IN_PROCESS_TRANSFERS = ("fake",)


def check_role(role: str, tensor_parallel_size: int, transfer_backend: str = "mooncake") -> None:
    """ValueError unless a node of `role` can run at this size: a prefill or decode node at
    TP > 1 moves each rank's KV from or into that rank's own process, which a transfer
    backend that copies only inside one process cannot do."""
    if tensor_parallel_size > 1 and role in ("prefill", "decode") and transfer_backend in IN_PROCESS_TRANSFERS:
        raise ValueError(f"tensor_parallel_size > 1 on a {role} node needs a transfer backend between "
                         f"processes (mooncake or grpc), not {transfer_backend!r}")
