"""A Mixture-of-Experts decode step on the CPU: pdmesh's expert path (tokens sorted by
expert, one gated MLP per active expert on oneDNN-packed weights: kernels/cpu.py) against a
per-expert Python loop (every expert masks the batch for its tokens, as transformers' eager
MoE does; the same packed matmuls) and against the same path on unpacked weights, and the
layouts over two ranks: experts split by columns (TP 2), placed whole (EP 2) with the
all-reduce dispatch and with all_to_all (common/model/layers/moe_dispatch.py).

    python bench/moe_step.py [--batches 1,16] [--steps 32] [--rounds 3] [--out bench/results/moe_step.json]

The model: a tiny-but-not-toy Qwen3-MoE made by the tiny maker (8 layers, hidden 1024,
16 heads, 4 KV heads, 32 experts of 512 columns, top-4, vocabulary 640; fp32, 1.7 GB),
under models/. Decode step: the median of `steps` engine steps of `batch` requests
decoding together (16-token prompts, greedy), each engine in turn per round; ratios per
round, their median. Routing overhead: one MoE layer at batch 16, its whole time against
its experts' matmuls alone (router, sort, gather, weighting and index_add are the rest).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import types
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
    "tp1": {}, "tp1-loop": {}, "tp1-unpacked": {},
    "tp2-columns": dict(tensor_parallel_size=2),
    "ep2-all_reduce": dict(tensor_parallel_size=2, enable_expert_parallel=True),
    "ep2-all_to_all": dict(tensor_parallel_size=2, enable_expert_parallel=True, moe_dispatch="all_to_all"),
}


def loop_over_experts(self, x, weights, ids, w13, w2, first_expert=0):
    """The baseline: for every expert, find its tokens by a mask over the whole batch (the
    same packed matmuls as pdmesh's path: only the loop differs)."""
    out = torch.zeros_like(x)
    for e in range(len(w13)):
        token, choice = torch.where(ids == e + first_expert)
        if token.numel() == 0:
            continue
        h = self.linear(self.silu_and_mul(self.linear(x[token], w13[e], None)), w2[e], None)
        out.index_add_(0, token, h * weights[token, choice, None].to(x.dtype))
    return out


def unpack_experts(llm: LLM) -> None:
    """pdmesh's path on the experts in their plain layout (F.linear, no oneDNN packing)."""
    for layer in llm.engine.model.layers:
        if hasattr(layer.mlp, "prepared"):
            w13, w2 = layer.mlp.prepared
            layer.mlp.prepared = (torch.stack([w.to_dense() for w in w13]), torch.stack([w.to_dense() for w in w2]))


def expert_bytes(llm: LLM) -> int:
    """Rank 0's routed-expert parameters, as loaded."""
    return sum(size for name, size in llm.engine.model.dense_bytes.items() if name.endswith((".w13", ".w2")))


def median_time(fn, reps: int = 30) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.inference_mode()
def routing_overhead(llm: LLM, batch: int) -> dict:
    model = llm.engine.model
    moe = model.layers[0].mlp
    x = torch.randn(batch, model.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    _, ids = moe.gate(x)
    w13, w2 = moe.prepared
    backend = model.backend
    groups = [(e, (ids == e).any(dim=1).nonzero().squeeze(1)) for e in range(moe.num_local)]
    inputs = [(e, x[rows]) for e, rows in groups if rows.numel()]

    def matmuls():
        for e, rows in inputs:
            backend.linear(backend.silu_and_mul(backend.linear(rows, w13[e], None)), w2[e], None)

    layer = median_time(lambda: moe(x, model.backend))
    experts = median_time(matmuls)
    return {"batch": batch, "layer_ms": layer * 1e3, "expert_matmuls_ms": experts * 1e3,
            "overhead_share": (layer - experts) / layer}


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
    engines = {}
    for name in names:
        if name not in ENGINES:
            raise SystemExit(f"--engines: unknown {name!r}; allowed: {', '.join(ENGINES)}")
        engines[name] = LLM(str(MODEL_DIR), kernel_backend="cpu", num_blocks=256, **ENGINES[name])
        if name.endswith("-loop"):         # each engine has a backend of its own
            backend = engines[name].engine.model.backend
            backend.routed_experts = types.MethodType(loop_over_experts, backend)
        if name.endswith("-unpacked"):
            unpack_experts(engines[name])
    vocab = MODEL["vocab_size"]
    batches = [int(b) for b in args.batches.split(",")]
    for llm in engines.values():
        for b in batches:
            decode_step(llm, b, 4, vocab)
    timings = {name: {b: [] for b in batches} for name in engines}
    for r in range(args.rounds):
        for b in batches:
            for name, llm in engines.items():
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
    report["routing_overhead"] = routing_overhead(engines["tp1"], 16)
    o = report["routing_overhead"]
    print(f"routing overhead at batch 16: layer {o['layer_ms']:.2f} ms, expert matmuls {o['expert_matmuls_ms']:.2f} ms "
          f"-> {o['overhead_share']:.0%} of the layer")
    for llm in engines.values():
        llm.close()
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
