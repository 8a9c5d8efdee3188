"""Issue 14 item 3: would the engine core in its own process (vLLM V1's EngineCoreProc)
pay on this machine? Two arms, one server script (bench/engine_server.py) that differs
only in where the engine steps:

    A  thread   AsyncEngine's step loop on a thread of the gRPC process (today's `both` node)
    B  process  the engine core in a child process (bench/engine_core.py), the gRPC
                process holding only the event loop

    python bench/engine_process.py [--num-requests 32] [--rates 1,inf] [--rounds 2]

Both serve the real DecodeServicer (one DecodeResponse per token per request) on the bench
model (bench_model.py: 90M fp32 Llama) with bench/serving.py's engine settings and the
engine's CPU defaults, the OpenMP environment `pdmesh up` gives an engine
(cpu_budget.OPENMP_WAIT_ENV). The client is `pdmesh bench serve`'s (services/bench: its
seeded log-normal dataset, Poisson or burst runner, metrics), here over Decode.Generate.
Each round starts arm A fresh, warms it up, runs every rate, stops it; then arm B the
same way; --rounds times (A, B, A, B, ...). Greedy, ignore_eos, the same requests and
seeds for every run; every run's output token ids are compared per request with the
first run's.

Per run: output tok/s, TTFT, TPOT, ITL percentiles; the serving process's event-loop lag
(a callback due every 5 ms: how late it ran, p50/p99); the engine's step durations
(p50, and how many steps); CPU seconds of the serving
process, its loop thread and the engine (thread or core process). Writes
bench/results/engine_process.json (command, machine, per-round figures, medians over
rounds, ratios B/A of the medians) and prints a summary.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]   # the repository's kernels package before bench/kernels.py
from bench_model import BENCH_MODEL, ensure_bench_model  # noqa: E402
from engine_server import CONTROL_SERVICE, ENGINE  # noqa: E402

from common.cpu_budget import OPENMP_WAIT_ENV  # noqa: E402
from protos.pdmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc  # noqa: E402
from services.bench.datasets import random_requests  # noqa: E402
from services.bench.machine import machine_info  # noqa: E402
from services.bench.metrics import RequestResult, summarize  # noqa: E402
from services.bench.runner import run_at_rate  # noqa: E402
from services.bench.serve import command_line  # noqa: E402

ARMS = ("thread", "process")
SERVER = Path(__file__).resolve().parent / "engine_server.py"
# the figures compared, as (name, path into a run's summary)
FIGURES = (("output_tok_s", ("output_throughput",)), ("ttft_p50_ms", ("ttft", "median_ms")),
           ("tpot_p50_ms", ("tpot", "median_ms")), ("tpot_p99_ms", ("tpot", "p99_ms")),
           ("itl_p50_ms", ("itl", "median_ms")), ("itl_p99_ms", ("itl", "p99_ms")),
           ("loop_lag_p50_ms", ("loop", "lag", "p50_ms")), ("loop_lag_p99_ms", ("loop", "lag", "p99_ms")),
           ("step_p50_ms", ("loop", "step", "p50_ms")), ("steps", ("loop", "step", "steps")),
           ("loop_cpu_s", ("loop", "cpu_s", "loop_thread")))


class DecodeBackend:
    """services/bench's Backend timing (services/bench/grpc_backend.py) over Decode.Generate."""

    name = "decode"

    def __init__(self, address: str, timeout_s: float = 600.0):
        self._channel = grpc.aio.insecure_channel(address)
        self._stub = engine_pb2_grpc.DecodeStub(self._channel)
        self._ids = itertools.count()
        self.timeout_s = timeout_s
        self._control = {m: self._channel.unary_unary(f"/{CONTROL_SERVICE}/{m}", request_serializer=str.encode,
                                                      response_deserializer=json.loads)
                         for m in ("ResetStats", "GetStats")}

    async def control(self, method: str) -> dict:
        return await self._control[method]("{}", timeout=30)

    async def one_request(self, req) -> RequestResult:
        result = RequestResult(num_prompt_tokens=req.num_prompt_tokens)
        msg = engine_pb2.DecodeRequest(request_id=f"bench-{next(self._ids)}", prompt_token_ids=req.prompt_token_ids,
                                       sampling=common_pb2.SamplingParams(max_tokens=req.max_tokens, temperature=0.0,
                                                                          ignore_eos=req.ignore_eos))
        start = time.perf_counter()
        last = None
        try:
            async for reply in self._stub.Generate(msg, timeout=self.timeout_s):
                now = time.perf_counter()
                if reply.token_ids:
                    if last is None:
                        result.ttft_s = now - start
                    else:
                        result.itl_s.append(now - last)
                    last = now
                    result.num_output_tokens += len(reply.token_ids)
                    result.output_token_ids.extend(reply.token_ids)
            result.e2e_s = time.perf_counter() - start
        except grpc.aio.AioRpcError as e:
            result.error = e.code().name
        return result

    async def close(self) -> None:
        await self._channel.close()


class Server:
    """One bench/engine_server.py process in its own session (stop() ends it and its core)."""

    def __init__(self, arm: str, model: Path, log_dir: Path, engine_args: dict):
        self.arm = arm
        self.log_path = log_dir / f"server-{arm}-{time.monotonic_ns()}.log"
        self.args = [sys.executable, str(SERVER), "--model", str(model), "--engine", arm,
                     "--engine-args", json.dumps(engine_args)]
        self.process: subprocess.Popen | None = None
        self.address = ""

    def start(self) -> float:
        """Seconds until it served; RuntimeError with its log's tail if it exited first."""
        start = time.monotonic()
        env = {**OPENMP_WAIT_ENV, **os.environ,
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=self._log, env=env,
                                        start_new_session=True, cwd=ROOT)
        line = self.process.stdout.readline().decode()   # the server prints only READY <port>
        if not line.startswith("READY "):
            self.stop()
            raise RuntimeError(f"the {self.arm} server did not start:\n{self.log_tail()}")
        self.address = f"127.0.0.1:{int(line.split()[1])}"
        return time.monotonic() - start

    def log_tail(self, num_lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])

    def stop(self, grace_s: float = 30.0) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        if self.process is not None:
            self.process.stdout.close()
            self._log.close()


async def measure(server: Server, requests: list, rates: list[float], seed: int, warmup: int) -> list[dict]:
    """Warm the server up, then one run per rate: the summary, the loop's stats, the token ids."""
    backend = DecodeBackend(server.address)
    try:
        for req in requests[:warmup]:
            await backend.one_request(req)
        runs = []
        for rate in rates:
            await backend.control("ResetStats")
            results, duration = await run_at_rate(backend, requests, rate, seed)
            loop = await backend.control("GetStats")
            summary = summarize(results, duration)
            runs.append({"rate": rate_key(rate), **summary, "loop": loop,
                         "ttft_ms_per_request": [round(r.ttft_s * 1e3, 1) for r in results],
                         "e2e_ms_per_request": [round(r.e2e_s * 1e3, 1) for r in results],
                         "token_ids": [r.output_token_ids for r in results]})
            print(f"  {server.arm:>7} rate {rate_key(rate):>3}: {summary['completed']}/{len(results)} ok, "
                  f"{summary['output_throughput']:.1f} tok/s, TPOT p50 {summary['tpot']['median_ms']:.1f} ms, "
                  f"loop lag p50/p99 {loop['lag']['p50_ms']:.2f}/{loop['lag']['p99_ms']:.2f} ms", flush=True)
        return runs
    finally:
        await backend.close()


def rate_key(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def figure(run: dict, path: tuple[str, ...]) -> float:
    value = run
    for key in path:
        value = value[key]
    return float(value)


def compare_token_ids(reference: list[list[int]], other: list[list[int]]) -> dict:
    mismatches = [{"request": i, "first_diff": next((k for k, (u, v) in enumerate(zip(a, b)) if u != v),
                                                    min(len(a), len(b))), "lengths": [len(a), len(b)]}
                  for i, (a, b) in enumerate(zip(reference, other)) if a != b]
    return {"compared": len(reference), "identical": len(reference) - len(mismatches), "mismatches": mismatches}


def aggregate(rounds: list[dict], rates: list[str]) -> tuple[dict, dict]:
    """Medians over rounds per arm and rate, and the ratios process / thread of them."""
    medians = {key: {arm: {name: statistics.median(figure(r[arm][key], path) for r in rounds)
                           for name, path in FIGURES} for arm in ARMS} for key in rates}
    ratios = {key: {name: (medians[key]["process"][name] / medians[key]["thread"][name]
                           if medians[key]["thread"][name] else math.nan) for name, _ in FIGURES} for key in rates}
    return medians, ratios


def print_summary(medians: dict, ratios: dict, same: dict) -> None:
    """Medians over rounds, one column per figure, and the ratio B/A under each rate."""
    names = [name for name, _ in FIGURES]
    widths = [max(len(n), 7) for n in names]
    print(f"\n{'rate':>4} {'arm':>8} " + " ".join(f"{n:>{w}}" for n, w in zip(names, widths)))
    for key, arms in medians.items():
        for arm, figs in arms.items():
            print(f"{key:>4} {arm:>8} " + " ".join(f"{figs[n]:{w}.2f}" for n, w in zip(names, widths)))
        print(f"{key:>4} {'B/A':>8} " + " ".join(f"{ratios[key][n]:{w}.2f}" for n, w in zip(names, widths)))
    print(f"token ids identical to the first run: {same['identical']}/{same['compared']} request-runs")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--rates", default="1,inf", help="requests/s, comma-separated; inf = all at once")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--input-len", type=int, default=190)
    ap.add_argument("--output-len", type=int, default=65)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=2, help="requests sent one at a time before the runs")
    ap.add_argument("--model", default="", help="model folder (default: the bench model, made if missing)")
    ap.add_argument("--engine-args", default="{}", help="JSON: EngineConfig fields over bench/serving.py's ENGINE")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "engine_process.json"))
    args = ap.parse_args()
    if args.rounds < 1 or args.num_requests < 1:
        raise SystemExit("--rounds and --num-requests must be >= 1")
    rates = [float(r) for r in args.rates.split(",")]
    keys = [rate_key(r) for r in rates]
    model = Path(args.model) if args.model else ensure_bench_model()
    engine_args = json.loads(args.engine_args)
    vocab_size = BENCH_MODEL["vocab_size"] if not args.model else json.loads((model / "config.json").read_text())["vocab_size"]
    max_model_len = engine_args.get("max_model_len", ENGINE["max_model_len"])
    requests = random_requests(args.num_requests, args.input_len, args.output_len, vocab_size, seed=args.seed,
                               max_model_len=max_model_len)
    work = Path(tempfile.mkdtemp(prefix="pdmesh-engine-process-"))
    started = time.monotonic()
    rounds, token_ids, startup = [], {}, {arm: [] for arm in ARMS}
    for index in range(args.rounds):
        rounds.append({})
        for arm in ARMS:
            print(f"--- round {index + 1}: {arm}", flush=True)
            server = Server(arm, model, work, engine_args)
            try:
                startup[arm].append(server.start())
                runs = asyncio.run(measure(server, requests, rates, args.seed, args.warmup))
            finally:
                server.stop()
            for run in runs:
                token_ids[f"{index}/{arm}/{run['rate']}"] = run.pop("token_ids")
            rounds[-1][arm] = {run["rate"]: run for run in runs}
    failed = sum(run["failed"] for r in rounds for arm in ARMS for run in r[arm].values())
    medians, ratios = aggregate(rounds, keys)
    reference = next(iter(token_ids.values()))
    per_run = {name: compare_token_ids(reference, ids) for name, ids in token_ids.items()}
    same = {"compared": sum(c["compared"] for c in per_run.values()),
            "identical": sum(c["identical"] for c in per_run.values())}
    report = {"command": command_line(["python", "bench/engine_process.py", *sys.argv[1:]]),
              "machine": machine_info(), "model": model.name, "engine": {**ENGINE, **engine_args},
              "openmp_env": OPENMP_WAIT_ENV, "arms": {"A": "thread", "B": "process"},
              "num_requests": args.num_requests, "rates": keys, "rounds_run": args.rounds, "seed": args.seed,
              "dataset": {"prompt_tokens": [r.num_prompt_tokens for r in requests],
                          "output_tokens": [r.max_tokens for r in requests]},
              "startup_s": startup, "duration_s": time.monotonic() - started,
              "rounds": rounds, "medians": medians, "ratios_process_over_thread": ratios,
              "token_ids": {"reference": next(iter(token_ids)), **same, "per_run": per_run}, "failed": failed,
              "logs": str(work)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print_summary(medians, ratios, same)
    print(f"wrote {args.out} in {report['duration_s']:.0f} s (server logs in {work})")
    return 1 if failed or same["identical"] != same["compared"] else 0


if __name__ == "__main__":
    sys.exit(main())
