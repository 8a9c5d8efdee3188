"""The server bench/engine_process.py measures: a grpc.aio server on 127.0.0.1 serving the
real DecodeServicer (services/decode/servicer.py: one DecodeResponse per token per
request, as a `both` node streams them), with the engine placed one of two ways:

    python bench/engine_server.py --model DIR --engine thread|process [--port 0]

- thread: AsyncEngine, its step loop on a thread of this process (what the services run);
- process: the engine core in a child process (bench/engine_core.py), this process
  holding only the event loop.

Everything else is the same in both: the servicer, a stand-in node (no membership, no KV
transfer: colocated only), the engine config (bench/serving.py's ENGINE and the engine's
CPU defaults), no interceptors, no TLS. Beside Decode it serves a JSON control service
(CONTROL_SERVICE: ResetStats, GetStats): the event loop's lag (a callback due every
LAG_INTERVAL_S; how late it ran), the engine's step durations (timed where it steps:
the step thread, or the core process) and the CPU seconds of this process, its event-loop
thread and the engine (its thread, or the core process) since the last reset.

Prints "READY <port>" on stdout once it serves; SIGTERM or SIGINT stops it (the core
process with it).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import grpc
import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]   # the repository's kernels package before bench/kernels.py

from common.config import EngineConfig  # noqa: E402
from protos.pdmesh.v1 import engine_pb2_grpc  # noqa: E402
from services.decode.servicer import DecodeServicer  # noqa: E402
from services.node.grpc_util import CHANNEL_OPTIONS  # noqa: E402
from services.node.metrics import NodeMetrics  # noqa: E402

ENGINE = {"num_blocks": 2048, "max_num_seqs": 64, "max_model_len": 2048}   # bench/serving.py's
CONTROL_SERVICE = "pdmesh.bench.EngineProcess"
LAG_INTERVAL_S = 0.005
MAX_QUEUE = 4096   # above any burst the bench sends: no RESOURCE_EXHAUSTED in either arm
CLOCK_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


class LoopLag:
    """A callback due every interval_s on the running loop; records how late each ran."""

    def __init__(self, interval_s: float = LAG_INTERVAL_S):
        self.interval_s = interval_s
        self.lags_s: list[float] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        due = self._loop.time() + self.interval_s
        self._loop.call_at(due, self._tick, due)

    def _tick(self, due: float) -> None:
        now = self._loop.time()
        self.lags_s.append(max(0.0, now - due))
        self._loop.call_at(now + self.interval_s, self._tick, now + self.interval_s)

    def summary(self) -> dict:
        ms = np.asarray(self.lags_s or [0.0]) * 1e3
        return {"samples": len(self.lags_s), "interval_ms": self.interval_s * 1e3, "mean_ms": float(ms.mean()),
                "p50_ms": float(np.percentile(ms, 50)), "p90_ms": float(np.percentile(ms, 90)),
                "p99_ms": float(np.percentile(ms, 99)), "max_ms": float(ms.max())}


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    """utime + stime of a process (all its threads) or of one of its threads."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    try:
        fields = Path(path).read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) * CLOCK_TICK_S


class Stats:
    """The control service: lag and CPU since the last ResetStats."""

    def __init__(self, mode: str, engine):
        self.mode, self.engine = mode, engine
        self.lag = LoopLag()
        self.loop_tid = threading.get_native_id()
        self._base: dict[str, float] = {}

    def _cpu(self) -> dict[str, float]:
        pid = os.getpid()
        cpu = {"server_process": cpu_seconds(pid), "loop_thread": cpu_seconds(pid, self.loop_tid)}
        if self.mode == "thread":
            cpu["engine_thread"] = cpu_seconds(pid, self.engine._thread.native_id)
        else:
            cpu["core_process"] = cpu_seconds(self.engine.process.pid)
        return cpu

    def reset(self, _request: dict) -> dict:
        self.lag.lags_s.clear()
        self.engine.step_s.clear()
        self._base = {**self._cpu(), "wall": time.monotonic()}
        return {"ok": True}

    def get(self, _request: dict) -> dict:
        now = {**self._cpu(), "wall": time.monotonic()}
        delta = {k: now[k] - self._base.get(k, 0.0) for k in now}
        steps = np.asarray(self.engine.step_s or [0.0]) * 1e3
        step = {"steps": len(self.engine.step_s), "mean_ms": float(steps.mean()),
                "p50_ms": float(np.percentile(steps, 50)), "p99_ms": float(np.percentile(steps, 99))}
        return {"engine": self.mode, "lag": self.lag.summary(), "step": step, "cpu_s": delta, "pid": os.getpid(),
                "torch_threads": (torch.get_num_threads() if self.mode == "thread" else
                                  self.engine.info["torch_threads"]), "env": {
                    k: os.environ[k] for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY") if k in os.environ}}


def control_handler(stats: Stats) -> grpc.GenericRpcHandler:
    def unary(fn):
        async def call(request: dict, _context) -> dict:
            return fn(request)
        return grpc.unary_unary_rpc_method_handler(
            call, request_deserializer=lambda b: json.loads(b or b"{}"),
            response_serializer=lambda d: json.dumps(d).encode())
    return grpc.method_handlers_generic_handler(CONTROL_SERVICE, {"ResetStats": unary(stats.reset),
                                                                  "GetStats": unary(stats.get)})


def stand_in_node(engine) -> SimpleNamespace:
    """What DecodeServicer reads of an EngineNode, for a colocated node without a mesh."""
    return SimpleNamespace(engine=engine, node=SimpleNamespace(node_id="bench-0", max_queue=MAX_QUEUE),
                           mesh=SimpleNamespace(timeouts=SimpleNamespace(request_s=600.0)),
                           metrics=NodeMetrics("bench-0", snapshot=dict, transfer=None))


def make_engine(mode: str, config: EngineConfig):
    """The engine, with `step_s`: each step's duration (appended by whoever steps)."""
    if mode == "thread":
        from common.engine.async_engine import AsyncEngine
        engine = AsyncEngine(config)
        engine.step_s = []
        step = engine.engine.step

        def timed_step():   # on the step thread; list.append is atomic under the GIL
            start = time.perf_counter()
            try:
                return step()
            finally:
                engine.step_s.append(time.perf_counter() - start)
        engine.engine.step = timed_step
        return engine
    if mode == "process":
        from engine_core import EngineCoreClient
        return EngineCoreClient(config)
    raise ValueError(f"--engine must be one of thread, process; got {mode!r}")


async def serve(mode: str, config: EngineConfig, port: int) -> None:
    engine = make_engine(mode, config)
    try:
        server = grpc.aio.server(options=CHANNEL_OPTIONS)
        engine_pb2_grpc.add_DecodeServicer_to_server(DecodeServicer(stand_in_node(engine)), server)
        stats = Stats(mode, engine)
        server.add_generic_rpc_handlers((control_handler(stats),))
        port = server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        stats.lag.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        print(f"READY {port}", flush=True)
        await stop.wait()
        await server.stop(1.0)
    finally:
        engine.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--engine", choices=("thread", "process"), required=True)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--engine-args", default="{}", help="JSON: EngineConfig fields over ENGINE")
    args = ap.parse_args()
    config = EngineConfig.from_kwargs(args.model, **{**ENGINE, **json.loads(args.engine_args)})
    asyncio.run(serve(args.engine, config, args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
