"""Tensor parallelism inside one engine (DESIGN.md "Tensor parallelism (per node)").

    shard.py        which heads / columns / vocab rows a rank holds; the size check
    group.py        a rank's collectives (gloo on cpu, nccl on cuda, hccl on npu)
    step_inputs.py  one step's inputs as ints and their broadcast form
    executor.py     rank 0's side: spawns the workers, sends each step, detects failure
    worker.py       ranks 1..N-1: load a shard, step in lockstep with rank 0

Modules here import torch lazily where they can, so config code may import shard.py.
"""
from __future__ import annotations

ROLES_WITH_TP = ("both",)


def check_role(role: str, tensor_parallel_size: int) -> None:
    """ValueError unless a node of `role` can run at this size: a node that pushes or
    receives KV (prefill, decode) runs at tensor_parallel_size 1 for now."""
    if tensor_parallel_size > 1 and role not in ROLES_WITH_TP:
        raise ValueError(f"tensor_parallel_size > 1 is served only by role {ROLES_WITH_TP} for now "
                         f"(KV transfer between sharded nodes is not built); node role is {role!r}")
