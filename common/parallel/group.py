"""The collectives of one tensor-parallel group, over a torch.distributed backend object.

Each engine makes its own group from a TCPStore that rank 0 hosts on 127.0.0.1 (port 0:
no port race), not the process-wide default group: several TP engines (tests, a bench)
may then live in one process. Backend by device: gloo on cpu, nccl on cuda, hccl on npu
(torch_npu; imported only there).

Timeouts are per rank: rank 0 waits at most `timeout_s` in any collective (its peers run
the same step, so a long wait means a peer hangs); a worker waits for rank 0's next step
without limit (idle engines are normal; a worker whose rank 0 is gone exits through its
parent watch, common/parallel/worker.py). A peer process that dies makes gloo raise at
once ("Connection closed by peer").

Not thread-safe: one thread issues a rank's collectives, in the same order on every rank.
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

BACKEND_BY_DEVICE = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
LOOPBACK = "127.0.0.1"


def backend_name(device: torch.device | str) -> str:
    kind = torch.device(device).type
    if kind not in BACKEND_BY_DEVICE:
        raise ValueError(f"tensor parallelism runs on {sorted(BACKEND_BY_DEVICE)}, got device {kind!r}")
    return BACKEND_BY_DEVICE[kind]


def _timeout(seconds: float | None) -> datetime.timedelta:
    return datetime.timedelta(days=365) if seconds is None else datetime.timedelta(seconds=seconds)


def make_store(rank: int, size: int, port: int = 0, timeout_s: float = 300.0) -> dist.TCPStore:
    """Rank 0 hosts (port 0 = a free one: read store.port); the others connect to port."""
    return dist.TCPStore(LOOPBACK, port, size, is_master=rank == 0, wait_for_workers=False,
                         timeout=_timeout(timeout_s))


def _backend(name: str, store, rank: int, size: int, timeout: datetime.timedelta):
    if name == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=LOOPBACK)]
        return dist.ProcessGroupGloo(store, rank, size, opts)
    if name == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    import torch_npu  # noqa: F401  (registers hccl; untested here: no Ascend device)
    from torch_npu._C._distributed_c10d import ProcessGroupHCCL
    return ProcessGroupHCCL(store, rank, size, timeout)


class TPGroup:
    """rank/size plus the collectives the sharded model and the step broadcast use.
    all_reduce, gather, all_gather and all_to_all run on the device's backend; broadcast (the step inputs, CPU
    int64 tensors) on gloo: the same group on cpu, a second one beside nccl / hccl, which
    take device tensors only (vLLM's cpu_group)."""

    def __init__(self, store, rank: int, size: int, device: torch.device | str,
                 timeout_s: float | None, name: str = "tp"):
        self.rank, self.size = rank, size
        self.device = torch.device(device)
        self.backend = backend_name(self.device)
        self._pg = _backend(self.backend, dist.PrefixStore(f"{name}/", store), rank, size,
                            _timeout(timeout_s))
        self._cpu_pg = self._pg if self.backend == "gloo" else _backend(
            "gloo", dist.PrefixStore(f"{name}/cpu/", store), rank, size, _timeout(timeout_s))

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place; returns tensor."""
        self._pg.allreduce([tensor]).wait()
        return tensor

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        """Rank root's CPU tensor into every rank's (same shape and dtype), in place, over
        gloo (whatever the device's backend)."""
        self._cpu_pg.broadcast([tensor], dist.BroadcastOptions() if root == 0 else _root(root)).wait()
        return tensor

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's tensor (same shape) on rank 0, in rank order; None elsewhere."""
        tensor = tensor.contiguous()
        if self.rank == 0:
            out = [torch.empty_like(tensor) for _ in range(self.size)]
            self._pg.gather([out], [tensor], dist.GatherOptions()).wait()
            return out
        self._pg.gather([], [tensor], dist.GatherOptions()).wait()
        return None

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's tensor (same shape) concatenated along dim 0, in rank order."""
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        self._pg.allgather([parts], [tensor.contiguous()]).wait()
        return torch.cat(parts)

    def all_to_all(self, tensor: torch.Tensor, out_rows: list[int], in_rows: list[int]) -> torch.Tensor:
        """Rows [sum(in_rows[:j]), + in_rows[j]) of tensor go to rank j; returns the rows
        received, out_rows[i] of them from rank i, in rank order (every rank's in_rows[j]
        to rank j must equal rank j's out_rows for it)."""
        out = tensor.new_empty((sum(out_rows), *tensor.shape[1:]))
        self._pg.alltoall_base(out, tensor.contiguous(), out_rows, in_rows, dist.AllToAllOptions()).wait()
        return out


def _root(root: int) -> dist.BroadcastOptions:
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    return opts
