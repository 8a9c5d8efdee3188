"""An engine's CPU budget: decode step time with 1 or 2 OpenMP threads, pinned or not,
under each OpenMP wait policy, on a quiet machine and beside a competing busy process
(one Python busy loop, not pinned), interleaved in one run.

Each configuration is its own engine process (libgomp reads its environment only when
torch loads it) on the bench model (90M fp32 Llama), started once and kept. For each load
(quiet, then busy), --reps times, every configuration in turn decodes --steps steps at
each batch size (prompts of 32 tokens, greedy); the step times and the CPU time the
engine used over them are recorded. Taking turns in short bursts spreads every
configuration over the same stretch of a shared machine's noise. The ratios are medians
over reps of the per-rep ratio of median step times against BASELINE (2 threads, not
pinned, libgomp's default wait: pdmesh before the budget), and of busy over quiet.
`fresh` configurations (OMP_WAIT_POLICY=ACTIVE: its idle threads spin for good, which
would load the others' turns) run alone, after the rest, in a process of their own.

    python bench/cores.py [--reps 5] [--steps 8] [--batch-sizes 1,8] [--configs 2t,1t-pin]
    python bench/cores.py --serving [--num-prompts 16]     # also: meshes under pdmesh bench serve

--serving also starts meshes with `pdmesh up`'s launcher and runs `pdmesh bench serve` on
each in turn (bench/cores_serving.py): colocated as planned (the engine on every core)
against the engine on one core with the control plane on the other, and against not
planned; 1P+1D with the cores split against not planned.

Writes bench/results/cores.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

from bench_model import BENCH_MODEL, DEFAULT_DIR, ROOT, ensure_bench_model

from bench_mesh import write_result  # noqa: E402

# name -> engine threads, engine cpu_cores (EngineConfig), extra environment
CONFIGS: dict[str, dict] = {
    "2t": dict(threads=2, cores="", env={}),
    "2t-passive": dict(threads=2, cores="", env={"OMP_WAIT_POLICY": "PASSIVE"}),
    "2t-spin10k": dict(threads=2, cores="", env={"GOMP_SPINCOUNT": "10000"}),
    "2t-bind": dict(threads=2, cores="", env={"OMP_PROC_BIND": "close", "OMP_PLACES": "cores"}),
    "1t": dict(threads=1, cores="", env={}),
    "1t-pin": dict(threads=1, cores="0", env={}),
    "1t-pin-passive": dict(threads=1, cores="0", env={"OMP_WAIT_POLICY": "PASSIVE"}),
    "2t-active": dict(threads=2, cores="", env={"OMP_WAIT_POLICY": "ACTIVE"}, fresh=True),
}
BASELINE = "2t"
LOADS = ("quiet", "busy")
PROMPT_LEN = 32
OPENMP_VARS = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_PROC_BIND", "OMP_PLACES",
               "GOMP_CPU_AFFINITY", "MKL_NUM_THREADS")


def child(spec: dict) -> int:
    """One engine process: load, warm up, print "ready"; then for each line "BATCH STEPS"
    on stdin decode that batch, print one JSON line {"times": [s...], "cpu_s"}."""
    import random

    import torch

    from common.engine import LLM, SamplingParams
    llm = LLM(spec["model"], num_threads=spec["threads"], cpu_cores=spec["cores"],
              max_num_seqs=spec["max_batch"], num_blocks=512)
    engine, rng, vocab = llm.engine, random.Random(0), BENCH_MODEL["vocab_size"]

    def decode(batch: int, steps: int, tag: str) -> dict:
        params = SamplingParams(max_tokens=steps + 3, temperature=0.0, ignore_eos=True)
        for i in range(batch):
            engine.add_request(f"{tag}-{i}", [rng.randrange(3, vocab) for _ in range(PROMPT_LEN)], params)
        engine.step()   # prefill (one chunk)
        engine.step()
        times, cpu0 = [], time.process_time()
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        cpu_s = time.process_time() - cpu0
        while engine.has_unfinished():
            engine.step()
        return {"times": times, "cpu_s": cpu_s}

    decode(spec["max_batch"], 4, "warm")
    print(json.dumps({"affinity": sorted(os.sched_getaffinity(0)), "threads": torch.get_num_threads()}), flush=True)
    for n, line in enumerate(sys.stdin):
        batch, steps = map(int, line.split())
        print(json.dumps(decode(batch, steps, f"r{n}")), flush=True)
    return 0


class Engine:
    """One configuration's engine process."""

    def __init__(self, name: str, model: str, max_batch: int):
        cfg = CONFIGS[name]
        spec = {"model": model, "threads": cfg["threads"], "cores": cfg["cores"], "max_batch": max_batch}
        env = {k: v for k, v in os.environ.items() if k not in OPENMP_VARS}
        env.update(cfg["env"])
        self.name = name
        self.proc = subprocess.Popen([sys.executable, __file__, "--child", json.dumps(spec)], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.info = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name}: the engine process died (exit {self.proc.wait()})")
        return json.loads(line)

    def decode(self, batch: int, steps: int) -> dict:
        self.proc.stdin.write(f"{batch} {steps}\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


class BusyLoad:
    """A Python busy loop (one core's worth of competing work) while the block runs."""

    def __init__(self, on: bool):
        self.on, self.proc = on, None

    def __enter__(self):
        if self.on:
            self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            time.sleep(0.3)
        return self

    def __exit__(self, *exc):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()


def run_block(names: list[str], load: str, args, model: str, samples: dict) -> None:
    """Start the engines of names, then --reps turns of each decoding every batch size;
    samples[(load, name, batch)] gets one {"times", "cpu_s"} per rep."""
    engines = {}
    try:
        for name in names:
            engines[name] = Engine(name, model, max(args.batch_sizes))
        with BusyLoad(load == "busy"):
            for rep in range(args.reps):
                order = names if rep % 2 == 0 else names[::-1]
                for name in order:
                    for batch in args.batch_sizes:
                        samples.setdefault((load, name, batch), []).append(engines[name].decode(batch, args.steps))
                line = "  ".join(f"{n} {1e3 * statistics.median(samples[(load, n, b)][-1]['times']):.0f}"
                                 for n in names for b in args.batch_sizes[:1])
                print(f"{load:<5} rep {rep + 1}/{args.reps} (b{args.batch_sizes[0]} ms): {line}", flush=True)
    finally:
        for engine in engines.values():
            engine.close()


def summarize(samples: dict, names: list[str], batch_sizes: list[int]) -> dict:
    """{load: {config: {batch: {step_ms, p90_ms, tok_s, cores_used, step_vs_baseline,
    busy_over_quiet}}}}; ratios are medians over reps of per-rep ratios of medians."""
    med = {key: [statistics.median(r["times"]) for r in reps] for key, reps in samples.items()}
    out: dict = {}
    for load in LOADS:
        for name in names:
            for b in batch_sizes:
                reps = samples.get((load, name, b))
                if not reps:
                    continue
                times = sorted(t for r in reps for t in r["times"])
                step = statistics.median(times)
                row = {"step_ms": step * 1e3, "p90_ms": times[int(0.9 * (len(times) - 1))] * 1e3,
                       "tok_s": b / step, "cores_used": sum(r["cpu_s"] for r in reps) / sum(times)}
                base = med.get((load, BASELINE, b))
                if base and name != BASELINE:
                    row["step_vs_baseline"] = statistics.median(x / y for x, y in zip(med[(load, name, b)], base))
                    if CONFIGS[name].get("fresh"):
                        row["baseline_in_other_turns"] = True
                quiet = med.get(("quiet", name, b))
                if load == "busy" and quiet:
                    row["busy_over_quiet"] = statistics.median(med[(load, name, b)]) / statistics.median(quiet)
                out.setdefault(load, {}).setdefault(name, {})[str(b)] = row
    return out


def print_summary(summary: dict) -> None:
    print(f"\nmedian decode step ms (x {BASELINE}, same turns) [busy: x quiet] {{cores used}}")
    for load, per in summary.items():
        for name, cells in per.items():
            text = "  ".join(
                f"b{b} {c['step_ms']:6.1f}" + (f" ({c['step_vs_baseline']:.2f}x)" if "step_vs_baseline" in c else "")
                + (f" [{c['busy_over_quiet']:.2f}x]" if "busy_over_quiet" in c else "")
                + f" {{{c['cores_used']:.2f}}}" for b, c in cells.items())
            print(f"{load:<5} {name:<15} {text}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=8, help="timed decode steps per turn and batch size")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"among {', '.join(CONFIGS)}")
    ap.add_argument("--serving", action="store_true", help="also compare meshes under pdmesh bench serve")
    ap.add_argument("--num-prompts", type=int, default=16, help="--serving: requests per rate")
    ap.add_argument("--rates", default="1,inf", help="--serving: request rates")
    ap.add_argument("--serving-rounds", type=int, default=1, help="--serving: rounds over the meshes")
    ap.add_argument("--meshes", default="", help="--serving: which meshes (default: all of cores_serving.MESHES)")
    ap.add_argument("--model-dir", default=str(DEFAULT_DIR))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "cores.json"))
    args = ap.parse_args()
    if args.child:
        return child(json.loads(args.child))
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    names = args.configs.split(",")
    unknown = sorted(set(names) - set(CONFIGS))
    if unknown:
        ap.error(f"--configs: unknown {unknown}; allowed: {sorted(CONFIGS)}")
    model = str(ensure_bench_model(args.model_dir))
    started, load_before = time.monotonic(), os.getloadavg()
    samples: dict = {}
    shared = [n for n in names if not CONFIGS[n].get("fresh")]
    for load in LOADS:
        run_block(shared, load, args, model, samples)
    for name in (n for n in names if CONFIGS[n].get("fresh")):
        for load in LOADS:
            run_block([name], load, args, model, samples)
    summary = summarize(samples, names, args.batch_sizes)
    print_summary(summary)
    report = {"command": "python bench/cores.py " + " ".join(sys.argv[1:]), "model": os.path.basename(model),
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                          "load_avg_before": load_before, "load_avg_after": os.getloadavg()},
              "baseline": BASELINE, "configs": {n: CONFIGS[n] for n in names}, "prompt_len": PROMPT_LEN,
              "reps": args.reps, "steps": args.steps, "summary": summary,
              "samples": [{"load": k[0], "config": k[1], "batch": k[2], "reps": v} for k, v in samples.items()]}
    if args.serving:
        from cores_serving import compare_meshes
        report["serving"] = compare_meshes(args)
        report["machine"]["load_avg_after"] = os.getloadavg()
    report["wall_s"] = time.monotonic() - started
    return write_result(args.out, report, ok=True)


if __name__ == "__main__":
    sys.exit(main())
