"""Tensor parallelism inside one engine: rank 0 is the engine's own process, ranks
1..N-1 are worker processes that step with it in lockstep.

Why this shape (vLLM's multiprocessing executor, not SGLang's all-ranks-schedule): the
scheduler, block manager, prefix cache and sampler stay single, in rank 0, with no
change: one block table serves every rank (each rank's KV cache has the same block ids,
holding its own KV heads), and only rank 0 samples. The services drive an engine of
any TP size through the same LLMEngine. The workers need no scheduler state at all:
each step, rank 0 broadcasts the step's StepInputs (token ids, positions, slots, block
tables, lengths, sample rows: common/parallel/step_wire.py), as one int64 tensor over
the group's own backend (gloo / nccl / hccl), then every rank runs its shard's forward:
two all-reduces a layer, one for the embedding, and a gather of the LM head's vocab
columns to rank 0. A tensor broadcast is cheaper than pickling objects over a pipe
every step and needs no second channel that could get out of step with the
collectives. Measured on the 2-core dev CPU (gloo on loopback; the tiny Llama, 4 layers,
8 decodes a step): packing ~0.1 ms and the one broadcast ~0.2 ms a step, next to 9
all-reduces of ~0.9 ms each; a TP 2 step took 21-26 ms against 5-6 ms at TP 1 (two
ranks on two cores: TP pays off only where a rank has its own device or cores).

KV transfer (nodes that push or receive KV): each worker makes its own transfer engine
(the factory given), registers its KV cache there and publishes it (kv_ranks, for the
node's NodeInfo); a prefill node's writes of worker ranks' heads go to them as orders over
a pipe each (rank_writes.py, `writers`).

Failure: rank 0 checks the workers' sentinels before each step (one select call) and
waits at most COLLECTIVE_TIMEOUT_S in any gloo collective; a dead peer makes gloo raise
at once. (On nccl / hccl the model's collectives do not block the CPU: a dead peer is
found by the sentinels and the next step's gloo broadcast, and a hung one by those
backends' own watchdogs; neither is tested here, which has no GPU or NPU.) Either way the step raises RuntimeError naming the rank, its pid and exit code,
the remaining workers are stopped, and every later step raises the same error. Workers
exit when rank 0's process is gone (worker.py). close() stops them (a stop message,
then SIGKILL: they ignore SIGTERM and SIGINT, which a stop of the node's process group
sends them too, so that they never die in the middle of a step rank 0 still finishes); a finalizer does the same when the executor is collected
or the interpreter exits, and the workers are daemonic.

Spawn (not fork: torch's threads and a forked gRPC runtime do not survive fork)
re-imports the main module in each worker, so a script that builds a TP engine must
keep its work under `if __name__ == "__main__":` (as with any spawn).
"""
from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import multiprocessing.connection
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Iterator

from common.config import EngineConfig
from common import cpu_budget
from common.parallel.group import TPGroup, make_store
from common.parallel.rank_writes import RankWriters
from common.parallel.step_wire import INLINE_LEN, HEADER_LEN, gather_message, pack, stop_message
from common.runner.step_inputs import StepInputs
from common.parallel.worker import WorkerSpec, main as worker_main

log = logging.getLogger("pdmesh.engine")

COLLECTIVE_TIMEOUT_S = 60.0     # rank 0's longest wait in one collective
STARTUP_TIMEOUT_S = 1800.0      # the workers' load (a big shard from a slow disk)
STOP_GRACE_S = 5.0

_groups = iter(range(1 << 62))


def rank_device(device: str, rank: int) -> str:
    """cpu for every rank; cuda:k / npu:k + rank otherwise (one device a rank)."""
    kind, _, index = device.partition(":")
    if kind == "cpu":
        return "cpu"
    return f"{kind}:{int(index or 0) + rank}"


def rank_cpu_budget(cpu_cores: tuple[int, ...], num_threads: int, size: int,
                    rank: int) -> tuple[tuple[int, ...], int]:
    """(cores, threads) of one rank: cpu_cores split in `size` contiguous shares when it
    has that many cores (else shared); num_threads as given, else one per core of the
    rank's share, else the cores this process may use split `size` ways (at least 1),
    so N ranks do not oversubscribe. At size 1: the arguments unchanged."""
    if size == 1:
        return cpu_cores, num_threads
    cores = cpu_cores
    if len(cpu_cores) >= size:
        share, extra = divmod(len(cpu_cores), size)
        start = rank * share + min(rank, extra)
        cores = cpu_cores[start:start + share + (1 if rank < extra else 0)]
    threads = num_threads or len(cores) or max(1, (len(cpu_budget.allowed_cpus()) or os.cpu_count() or 1) // size)
    return cores, threads


def _reap(procs: list) -> None:
    """SIGKILL what still runs (workers ignore SIGTERM, worker.py; they hold nothing that
    needs a graceful end: the stop message is that path) and reap it."""
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(2.0)


class TPExecutor:
    """Rank 0's side of a tensor-parallel engine. Lifecycle: __init__ (workers spawned,
    loading in parallel with rank 0) -> wait_ready() (the group) -> step(inputs)* ->
    close(). Not thread-safe: the engine's step thread drives it (close() from another
    thread only once steps have ended)."""

    def __init__(self, config: EngineConfig, *, dtype: str, num_blocks: int, block_size: int,
                 max_model_len: int, transfer_factory: Callable[[], object] | None = None,
                 weights: Callable[[object, int], object] | None = None, weights_identity: str = "",
                 keep_weights: bool = False):
        """transfer_factory: each worker makes its own transfer engine with it and takes KV
        write orders (writers, kv_ranks); None: the workers do no KV transfer. weights,
        weights_identity, keep_weights: where each worker's weights come from and whether
        it keeps them to serve (WorkerSpec); after wait_ready, `loaded` says where they came
        from and `weight_ranks` holds what each serves (serialized RankWeights, b"" for none)."""
        self.size = config.tensor_parallel_size
        self.device = rank_device(config.device, 0)
        self.group_name = f"tp{os.getpid()}-{next(_groups)}"
        self.store = make_store(0, self.size)
        self.group: TPGroup | None = None
        self._error: RuntimeError | None = None
        self._closed = False
        ctx = multiprocessing.get_context("spawn")
        from_main = threading.current_thread() is threading.main_thread()
        self.procs: list = []
        self._finalizer = weakref.finalize(self, _reap, self.procs)   # the same list, filled below
        self.writers: RankWriters | None = None
        self.kv_ranks: list[bytes] = []      # serialized KVRank of ranks 1.. (with transfer)
        self.weight_ranks: list[bytes] = []  # serialized RankWeights of ranks 1.. (with transfer)
        self.loaded: list[dict] = []         # ranks 1..: {source, seed, nbytes, seconds}
        conns = []
        for rank in range(1, self.size):
            cores, threads = rank_cpu_budget(config.cpu_cores, config.num_threads, self.size, rank)
            spec = WorkerSpec(config=config, rank=rank, store_port=self.store.port,
                              group_name=self.group_name, device=rank_device(config.device, rank),
                              dtype=dtype, num_blocks=num_blocks, block_size=block_size,
                              max_model_len=max_model_len, cpu_cores=cores, num_threads=threads,
                              parent_pid=os.getpid(), death_signal=from_main,
                              transfer_factory=transfer_factory, weights=weights,
                              weights_identity=weights_identity, keep_weights=keep_weights,
                              torch_npu_emulator=getattr(sys.modules.get("torch_npu"), "_pdmesh_install_options",
                                                         None))
            ours, theirs = ctx.Pipe() if transfer_factory is not None else (None, None)
            proc = ctx.Process(target=worker_main, args=(spec, theirs), name=f"pdmesh-tp-rank{rank}", daemon=True)
            proc.start()
            if theirs is not None:
                theirs.close()
                conns.append(ours)
            self.procs.append(proc)
        if conns:
            self.writers = RankWriters(conns)

    @property
    def pids(self) -> list[int]:
        """The worker processes' pids, rank 1 first."""
        return [p.pid for p in self.procs]

    def wait_ready(self) -> TPGroup:
        """After rank 0 loaded its shard: wait for every worker's, then form the group.
        RuntimeError (and the workers stopped) when one failed or exited."""
        keys = [f"{self.group_name}/ready/{r}" for r in range(1, self.size)]
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self.store.check(keys):
            dead = self._dead(timeout=0.05)
            if dead or time.monotonic() > deadline:
                self._error = RuntimeError(self._describe(dead) if dead else
                                           f"tensor-parallel workers not ready after {STARTUP_TIMEOUT_S:.0f}s")
                self.close()
                raise self._error
        if self.writers is not None:
            self.kv_ranks = [self.store.get(f"{self.group_name}/kv/{r}") for r in range(1, self.size)]
            self.weight_ranks = [self.store.get(f"{self.group_name}/weights/{r}") for r in range(1, self.size)]
        self.loaded = [json.loads(self.store.get(f"{self.group_name}/loaded/{r}")) for r in range(1, self.size)]
        try:
            self.group = TPGroup(self.store, 0, self.size, self.device, COLLECTIVE_TIMEOUT_S,
                                 name=self.group_name)
        except Exception as e:
            raise self._fail(e) from e
        log.info("tensor parallel: %d ranks over %s, workers %s", self.size, self.group.backend, self.pids)
        return self.group

    @contextlib.contextmanager
    def step(self, inputs: StepInputs) -> Iterator[None]:
        """Send the step's inputs to every worker, then run rank 0's forward inside (its
        collectives meet the workers'). Any error inside ends the group: RuntimeError,
        and the same one for every later step."""
        self._check_usable()
        try:
            self._send(pack(inputs))
            yield
        except Exception as e:
            raise self._fail(e) from e

    def gather_kv(self, kv_cache, block_ids: list[int]) -> list:
        """Between steps, on the thread that steps: every rank's KV of these blocks (all
        layers and planes: [L, planes, n, block_size, heads, head_dim] each), rank 0 first. Any
        error ends the group, as in step()."""
        self._check_usable()
        try:
            self._send(gather_message(block_ids))
            return self.group.gather(kv_cache[:, :, block_ids])
        except Exception as e:
            raise self._fail(e) from e

    def _check_usable(self) -> None:
        if self._error is not None:
            raise self._error
        if self._dead(timeout=0):
            raise self._fail(None)

    def _send(self, wire) -> None:
        """A message to every worker: one broadcast, or the header and then the payload."""
        self.group.broadcast(wire[:INLINE_LEN])
        if len(wire) > INLINE_LEN:
            self.group.broadcast(wire[HEADER_LEN:])

    def failure(self) -> str | None:
        """Why the group cannot step any more (a worker exited, an earlier step failed,
        or it was closed), or None. Never blocks (no join, no store read: another thread
        may be reaping the same process), so a node's health watch may call it on its
        event loop: a rank that dies while the engine is idle is found here, not only at
        the next step."""
        if self._error is not None:
            return str(self._error)
        dead = self._dead(timeout=0)
        return "; ".join(f"tensor-parallel rank {self.procs.index(p) + 1} (pid {p.pid}) exited"
                         for p in dead) or None

    def _dead(self, timeout: float) -> list:
        ready = multiprocessing.connection.wait([p.sentinel for p in self.procs], timeout)
        return [p for p in self.procs if p.sentinel in ready]

    def _describe(self, dead: list) -> str:
        parts = []
        for p in dead:
            rank = self.procs.index(p) + 1
            p.join(1.0)
            text = f"tensor-parallel rank {rank} (pid {p.pid}) exited with code {p.exitcode}"
            key = f"{self.group_name}/error/{rank}"
            if self.store.check([key]):
                text += ": " + self.store.get(key).decode(errors="replace").strip().splitlines()[-1]
            parts.append(text)
        return "; ".join(parts)

    def _fail(self, error: BaseException | None) -> RuntimeError:
        """The group is unusable from now on: record why, stop the workers."""
        if self._error is None:
            dead = self._dead(timeout=1.0)   # a crashed worker may still be exiting
            if dead:
                message = self._describe(dead)
            else:
                message = f"tensor-parallel step failed: {error!r}"
            self._error = RuntimeError(message)
            log.error("%s; stopping the other ranks", message)
            self._finalizer()
            if self.writers is not None:
                self.writers.close()
        return self._error

    def close(self, graceful: bool = True) -> None:
        """Stop every worker (idempotent): the stop message when the group is healthy and
        graceful (only on the thread that steps, or once no step can run: it is a
        collective), then SIGKILL for any still running."""
        if self._closed:
            return
        self._closed = True
        if graceful and self.group is not None and self._error is None and not self._dead(timeout=0):
            try:
                self.group.broadcast(stop_message())
            except Exception as e:   # a worker died meanwhile
                log.warning("tensor-parallel stop message failed: %r", e)
            deadline = time.monotonic() + STOP_GRACE_S
            for p in self.procs:
                p.join(max(0.0, deadline - time.monotonic()))
        self._finalizer()
        if self.writers is not None:
            self.writers.close()
        if self._error is None:
            self._error = RuntimeError("the tensor-parallel engine is closed")
