"""A Mixture-of-Experts decode step on the CPU: pdmesh's expert path (tokens sorted by
expert; a decode step's few rows an expert through the C++ kernel, kernels/csrc/moe_cpu.cpp)
against the same path with a oneDNN-packed GEMM per expert (no C++ kernels) and against a
per-expert Python loop (every expert masks the batch for its tokens and runs torch's
matmuls, as transformers' eager MoE does), and the layouts over two ranks: experts split by columns (TP 2), placed whole (EP 2) with the
all-reduce dispatch and with all_to_all (common/model/layers/moe_dispatch.py).

    python bench/moe_step.py [--batches 1,16] [--steps 32] [--rounds 3] [--out bench/results/moe_step.json]

The model: a tiny-but-not-toy Qwen3-MoE made by the tiny maker (8 layers, hidden 1024,
16 heads, 4 KV heads, 32 experts of 512 columns, top-4, vocabulary 640; fp32, 1.7 GB),
under models/. Decode step: the median of `steps` engine steps of `batch` requests
decoding together (16-token prompts, greedy), each engine in turn per round; ratios per
round, their median. Routing overhead: one MoE layer at batch 16, its whole time against
its experts' computation alone (router, sort, gather, weighting and index_add are the rest).
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from bench_model import ROOT
from quantize_speed import decode_step

from common.engine import LLM  # noqa: E402
from common.model.tiny import make_tiny_model  # noqa: E402
from services.bench.machine import machine_info  # noqa: E402

MODEL = dict(hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=4, intermediate_size=2048,
             vocab_size=640, num_experts=32, num_experts_per_tok=4)
MODEL_DIR = ROOT / "models" / "bench-qwen3-moe-e32"
ENGINES = {   # name -> LLM keyword arguments
    "tp1": {}, "tp1-packed": {}, "tp1-loop": {},
    "tp2-columns": dict(tensor_parallel_size=2),
    "ep2-all_reduce": dict(tensor_parallel_size=2, enable_expert_parallel=True),
    "ep2-all_to_all": dict(tensor_parallel_size=2, enable_expert_parallel=True, moe_dispatch="all_to_all"),
}


def loop_over_experts(x, weights, ids, w13, w2, first_expert=0):
    """The baseline: for every expert, find its tokens by a mask over the whole batch and
    run its MLP with torch's matmuls (transformers' eager MoE)."""
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        token, choice = torch.where(ids == e + first_expert)
        if token.numel() == 0:
            continue
        gate, up = torch.nn.functional.linear(x[token], w13[e]).chunk(2, dim=-1)
        h = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w2[e])
        out.index_add_(0, token, h * weights[token, choice, None].to(x.dtype))
    return out


def run_loop(moe, x, weights, ids, backend, first_expert):
    return loop_over_experts(x, weights, ids, *moe.prepared, first_expert)


def pack_experts(llm: LLM) -> None:
    """pdmesh's path without the C++ kernels: each expert oneDNN-packed, a GEMM per expert."""
    backend = llm.engine.model.backend
    for layer in llm.engine.model.layers:
        if hasattr(layer.mlp, "prepared"):
            w13, w2 = layer.mlp.prepared
            layer.mlp.prepared = ([backend.prepare_linear(w) for w in w13], [backend.prepare_linear(w) for w in w2])


def expert_bytes(llm: LLM) -> int:
    """Rank 0's routed-expert parameters, as loaded."""
    return sum(size for name, size in llm.engine.model.dense_bytes.items() if name.endswith((".w13", ".w2")))


def paired_times(first, second, reps: int = 200) -> tuple[float, float]:
    """Median seconds of each, timed in turn rep by rep (drift hits both alike)."""
    first(), second()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(reps):
        for fn, out in ((first, times[0]), (second, times[1])):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return statistics.median(times[0]), statistics.median(times[1])


@torch.inference_mode()
def routing_overhead(llm: LLM, batch: int) -> dict:
    """One MoE layer of the tp1 engine at `batch` tokens: its whole time against the experts'
    computation alone on rows already sorted (the C++ kernel's one call, or without the
    extension the packed GEMMs): the rest is the router, sort, gather and combine."""
    model = llm.engine.model
    moe, backend = model.layers[0].mlp, model.backend
    x = torch.randn(batch, model.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    _, ids = moe.gate(x)
    order = ids.reshape(-1).argsort(stable=True)
    rows = x[order // ids.shape[1]].contiguous()
    counts = torch.bincount(ids.reshape(-1), minlength=moe.num_local).tolist()
    w13, w2 = moe.prepared

    def experts():
        if not isinstance(w13, list):
            return backend.extension.moe_experts_few_rows(rows, w13, w2, counts)
        start = 0
        for e, n in enumerate(counts):
            if n:
                backend.linear(backend.silu_and_mul(backend.linear(rows[start:start + n], w13[e], None)), w2[e], None)
                start += n

    layer, alone = paired_times(lambda: moe(x, backend), experts)
    return {"batch": batch, "layer_ms": layer * 1e3, "experts_alone_ms": alone * 1e3,
            "overhead_share": (layer - alone) / layer}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--engines", default=",".join(ENGINES), help=f"of {', '.join(ENGINES)} (tp1 always runs)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "moe_step.json"))
    args = ap.parse_args()
    if not (MODEL_DIR / "config.json").exists():
        print(f"making the bench model in {MODEL_DIR}", flush=True)
        make_tiny_model("qwen3_moe", MODEL_DIR, **MODEL)
    names = ["tp1", *(n for n in args.engines.split(",") if n and n != "tp1")]
    engines, threads = {}, {}
    for name in names:
        if name not in ENGINES:
            raise SystemExit(f"--engines: unknown {name!r}; allowed: {', '.join(ENGINES)}")
        engines[name] = LLM(str(MODEL_DIR), kernel_backend="cpu", num_blocks=256, **ENGINES[name])
        threads[name] = torch.get_num_threads()     # the engine's rank 0 set it for this process
        if name.endswith("-loop"):         # the model's layers, not the backend: engines share it
            for layer in engines[name].engine.model.layers:
                if hasattr(layer.mlp, "prepared"):
                    layer.mlp.run_experts = functools.partial(run_loop, layer.mlp)
        if name.endswith("-packed"):
            pack_experts(engines[name])
    vocab = MODEL["vocab_size"]
    batches = [int(b) for b in args.batches.split(",")]
    for name, llm in engines.items():
        for b in batches:
            torch.set_num_threads(threads[name])
            decode_step(llm, b, 4, vocab)
    timings = {name: {b: [] for b in batches} for name in engines}
    for r in range(args.rounds):
        for b in batches:
            for name, llm in engines.items():
                torch.set_num_threads(threads[name])   # one process holds them all: each its own
                timings[name][b].append(decode_step(llm, b, args.steps, vocab))
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    report = {"command": " ".join(["python", "bench/moe_step.py", *sys.argv[1:]]), "machine": machine_info(),
              "model": {"dir": str(MODEL_DIR.relative_to(ROOT)), **MODEL}, "steps": args.steps,
              "rounds": args.rounds, "engines": {}}
    whole = expert_bytes(engines["tp1"])
    for name, llm in engines.items():
        entry = {"expert_bytes_rank0": expert_bytes(llm), "expert_bytes_ratio": expert_bytes(llm) / whole,
                 "decode_step_ms": {}, "ratio_to_tp1": {}}
        for b in batches:
            entry["decode_step_ms"][b] = [t * 1e3 for t in timings[name][b]]
            entry["ratio_to_tp1"][b] = statistics.median(t / f for t, f in zip(timings[name][b], timings["tp1"][b]))
        report["engines"][name] = entry
        steps = ", ".join(f"batch {b}: {statistics.median(entry['decode_step_ms'][b]):.1f} ms "
                          f"({entry['ratio_to_tp1'][b]:.2f}x)" for b in batches)
        print(f"{name:16s} rank-0 experts {entry['expert_bytes_rank0'] / 2**20:7.1f} MiB "
              f"({entry['expert_bytes_ratio']:.2f}x); decode step {steps}")
    torch.set_num_threads(threads["tp1"])
    report["routing_overhead"] = routing_overhead(engines["tp1"], 16)
    o = report["routing_overhead"]
    print(f"routing overhead at batch 16: layer {o['layer_ms']:.2f} ms, experts alone {o['experts_alone_ms']:.2f} ms "
          f"-> {o['overhead_share']:.0%} of the layer")
    for llm in engines.values():
        llm.close()
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
