"""A tensor-parallel worker: rank r > 0 of one engine, in its own (spawned) process.

Lifecycle (`main`):
    started (spawn)   watches its parent (sentinel thread; PR_SET_PDEATHSIG on Linux when
                      the parent spawned it from its main thread: that signal follows the
                      spawning thread, not the process)
    loading           its budget of cores/threads, its shard of the weights (sliced
                      reads), its KV cache: its KV heads, rank 0's block count and ids
    transfer          with a transfer factory (nodes that push or receive KV): its own
                      transfer engine (made before loading: a loader reads a weight seed's
                      memory with it), its KV cache registered there, published as store
                      key kv/<r> (a KVRank: endpoint + layout); rank 0 lists it in NodeInfo;
                      weights/<r>: its served weights (a RankWeights, or empty); loaded/<r>:
                      where its weights came from (JSON)
    ready             store key ready/<r>; on a load error, error/<r> holds the reason
    grouped           joins the TP group (no timeout: it waits for rank 0 while idle)
    stepping          receives each step's StepInputs (one broadcast, two when big), runs
                      its shard's forward (the all-reduces and the logits gather with
                      the other ranks); between steps, a GatherKV: sends those blocks of
                      its KV cache to rank 0; repeats until the stop message
    exited            0 after the stop message; 1 on an error (error/<r>), or at once
                      when rank 0's process is gone

Nothing is sent back but the collectives (rank 0 alone samples) and the answers to rank
0's KV write orders, which a thread of the worker runs beside the steps (rank_writes.py).
"""
from __future__ import annotations

import ctypes
import json
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from common.config import EngineConfig

log = logging.getLogger("pdmesh.engine")

PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class WorkerSpec:
    """What rank 0 decided and a worker needs (picklable)."""

    config: EngineConfig
    rank: int
    store_port: int
    group_name: str
    device: str
    dtype: str                  # a key of common/runner/dtypes.DTYPE_BY_NAME
    num_blocks: int
    block_size: int
    max_model_len: int
    cpu_cores: tuple[int, ...]
    num_threads: int
    parent_pid: int
    death_signal: bool          # PR_SET_PDEATHSIG (parent spawned from its main thread)
    # makes this rank's transfer engine (picklable, e.g. a functools.partial of a module
    # function); None: the rank neither pushes nor receives KV
    transfer_factory: Callable[[], object] | None = None
    # rank 0 runs on the torch_npu emulator (kernels/testing/fake_torch_npu.py, a machine
    # without an NPU): its install options; this rank installs it alike, before loading
    torch_npu_emulator: dict | None = None
    # where this rank's weights come from: weights(its transfer engine or None, rank) -> a
    # WeightSource (common/runner/weight_source.py; a peer's memory or the disk); None:
    # the disk. keep_weights: keep them as a pool to serve as a weight seed (rank 0 then
    # orders its registration: rank_writes.WeightsOrder)
    weights: Callable[[object, int], object] | None = None
    weights_identity: str = ""
    keep_weights: bool = False


def _watch_parent(spec: WorkerSpec) -> None:
    """Exit at once when rank 0's process is gone, however it ended."""
    if spec.death_signal and sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            pass
    if os.getppid() != spec.parent_pid:
        os._exit(1)   # the parent died before the signal was armed
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def wait() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=wait, name="tp-parent-watch", daemon=True).start()


def main(spec: WorkerSpec, writes_conn=None) -> None:
    """writes_conn: this end of rank 0's pipe for KV write orders (rank_writes.py)."""
    # rank 0 ends this process (the stop message, or SIGTERM/SIGKILL from close()); a
    # signal to the whole process group (Ctrl-C, `pdmesh up` stopping the node) must not
    # kill it in the middle of a step that rank 0 is still finishing
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _watch_parent(spec)
    import torch

    from common import cpu_budget
    from common.parallel.group import TPGroup, make_store

    cpu_budget.apply(spec.cpu_cores, spec.num_threads)
    if spec.torch_npu_emulator is not None:
        from kernels.testing import fake_torch_npu
        fake_torch_npu.install(**spec.torch_npu_emulator)
    size = spec.config.tensor_parallel_size
    store = make_store(spec.rank, size, spec.store_port)
    key = f"{spec.group_name}/"
    try:
        _set_device(spec.device)    # before the transfer engine: a device transport reads the current device
        # the transfer engine before the weights: a loader reads a weight seed's memory with it
        transfer = spec.transfer_factory() if spec.transfer_factory is not None else None
        runner = _load(spec, transfer)
        loaded = runner.model.loaded_weights
        print(f"tensor-parallel rank {spec.rank}: weights from {loaded.source}"
              f"{' seed ' + loaded.seed if loaded.seed else ''} ({loaded.nbytes / 1e6:.1f} MB in {loaded.seconds:.2f}s"
              f"{'; tried ' + '; '.join(loaded.tried) if loaded.tried else ''})", file=sys.stderr, flush=True)
        store.set(key + f"loaded/{spec.rank}", json.dumps({"source": loaded.source, "seed": loaded.seed,
                                                           "nbytes": loaded.nbytes, "seconds": loaded.seconds}))
        if transfer is not None:
            kv_rank, weights = _start_transfer(spec, runner, writes_conn, transfer)
            store.set(key + f"weights/{spec.rank}", weights)
            store.set(key + f"kv/{spec.rank}", kv_rank)
    except BaseException:
        store.set(key + f"error/{spec.rank}", traceback.format_exc(limit=5))
        sys.exit(1)
    store.set(key + f"ready/{spec.rank}", "1")
    try:
        group = TPGroup(store, spec.rank, size, spec.device, timeout_s=None, name=spec.group_name)
        runner.model.attach_group(group, spec.config.moe_dispatch)
        with torch.inference_mode():
            _serve(group, runner)
    except BaseException:
        store.set(key + f"error/{spec.rank}", traceback.format_exc(limit=5))
        sys.exit(1)


def _set_device(name: str) -> None:
    import torch
    device = torch.device(name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif device.type == "npu":
        import torch_npu  # noqa: F401  (untested here: no Ascend device)
        torch.npu.set_device(device)


def _load(spec: WorkerSpec, transfer):
    import torch

    from common.runner.dtypes import DTYPE_BY_NAME
    from common.runner.model_runner import ModelRunner, load_rank
    from common.engine_config import resolved_w8a8_mix_path
    from common.model.config import load_model_config
    from common.parallel.shard import plan_shard
    from kernels import get_backend

    cfg = spec.config
    device = torch.device(spec.device)
    mcfg = load_model_config(cfg.model)
    shard = plan_shard(mcfg, cfg.tensor_parallel_size, spec.rank, cfg.enable_expert_parallel)
    model, kv_cache = load_rank(mcfg, get_backend(cfg.kernel_backend, device), DTYPE_BY_NAME[spec.dtype], device,
                                cfg.model, shard, spec.max_model_len, spec.num_blocks, spec.block_size,
                                resolved_w8a8_mix_path(cfg), cfg.lm_head_quantization == "int8",
                                spec.weights(transfer, spec.rank) if spec.weights is not None else None,
                                spec.weights_identity, spec.keep_weights)
    return ModelRunner(model, kv_cache, spec.block_size)


def _start_transfer(spec: WorkerSpec, runner, writes_conn, transfer) -> tuple[bytes, bytes]:
    """This rank's transfer engine with its KV cache registered, the thread that runs rank
    0's write orders (and, for a weight seed, the registration of its weights); returns the
    serialized KVRank to publish, and the RankWeights of its weights (b"" when it keeps
    none). The engine lives as long as the process (its memory is the cache)."""
    from common.parallel.rank_writes import serve_writes
    from common.transfer.kv_writes import KVSender
    from common.kv_layout import KVLayout
    from protos.pdmesh.v1 import common_pb2

    kv_cache = runner.kv_cache
    transfer.register(kv_cache.data_ptr(), kv_cache.numel() * kv_cache.element_size())
    pool = runner.model.loaded_weights.pool
    weights = None
    if pool is not None:
        from common.runner.served_weights import RankPool
        weights = RankPool(spec.rank, transfer, pool)
    layout = KVLayout.of_cache(kv_cache, runner.model.kv_scales_id)
    # the worker has no logging set up: stderr is the node's log
    print(f"tensor-parallel rank {spec.rank}: KV cache registered with {transfer.name} at {transfer.endpoint}, "
          f"listening on {', '.join(transfer.listen_addresses) or 'no listener of its own'}", file=sys.stderr, flush=True)
    if writes_conn is not None:
        import torch
        device = kv_cache.device
        sync = None if device.type == "cpu" else (lambda: torch.accelerator.synchronize(device))
        threading.Thread(target=serve_writes, args=(writes_conn, KVSender(transfer, layout), sync, weights),
                         name="rank-writes", daemon=True).start()
    kv_rank = common_pb2.KVRank(transfer_endpoint=transfer.endpoint, layout=layout.to_proto(),
                                listen_addresses=list(transfer.listen_addresses)).SerializeToString()
    return kv_rank, weights.to_proto().SerializeToString() if weights is not None else b""


def _serve(group, runner) -> None:
    import torch

    from common.parallel.step_wire import INLINE_LEN, HEADER_LEN, GatherKV, is_inline, unpack

    wire = torch.empty(INLINE_LEN, dtype=torch.int64)
    while True:
        group.broadcast(wire)
        payload = None
        if not is_inline(wire):
            payload = group.broadcast(torch.empty(int(wire[HEADER_LEN - 1]), dtype=torch.int64))
        inputs = unpack(wire, payload)
        if inputs is None:
            return
        if isinstance(inputs, GatherKV):
            group.gather(runner.kv_cache[:, :, inputs.block_ids])
            continue
        runner.forward(inputs)
