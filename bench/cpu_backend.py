"""The `cpu` kernel backend against `ref`, alternating in one run, on the bench model.

    python bench/cpu_backend.py [--threads 1] [--iters 15] [--out bench/results/cpu_backend.json]

Three levels, each a ratio ref / cpu of median times:
- linear: the four matmuls of one decoder layer (qkv, o, gate_up, down) for a number of
  rows (decode batch sizes, a prefill chunk): F.linear against oneDNN-packed weights;
- decode attention: batch x context over shuffled blocks, C++ over block tables against
  ref's gathered tiles;
- engine decode step: LLMEngine.step() at batch x context after the prompts' prefill, two
  engines in this process, stepping in turn. The batch-1 step is also compared with its
  floor, the model's weight bytes over memory-copy bandwidth (a 1 GiB tensor copy)
  measured in the same run (issue 14's target: within 1.3x).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from bench_model import ensure_bench_model, BENCH_MODEL  # puts the repository on sys.path

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench_mesh import write_result  # noqa: E402
from common.config import EngineConfig  # noqa: E402
from common.engine.llm_engine import LLMEngine  # noqa: E402
from common.engine.sampling_params import SamplingParams  # noqa: E402
from kernels import DecodeMetadata, get_backend  # noqa: E402
from services.bench.machine import machine_info  # noqa: E402

LINEAR_ROWS = (1, 2, 4, 8, 16, 64, 256)
ATTENTION_SHAPES = ((1, 512), (8, 256), (16, 1024), (4, 4096))     # batch, context
STEP_SHAPES = ((1, 190), (2, 190), (4, 190), (8, 190), (16, 1024))


def medians_ms(fns, warmup: int, iters: int) -> list[float]:
    for _ in range(warmup):
        for fn in fns:
            fn()
    times = [[] for _ in fns]
    for _ in range(iters):
        for fn, t in zip(fns, times):
            start = time.perf_counter()
            fn()
            t.append(time.perf_counter() - start)
    return [statistics.median(t) * 1e3 for t in times]


def bench_linear(ref, cpu, args) -> list[dict]:
    h, inter = BENCH_MODEL["hidden_size"], BENCH_MODEL["intermediate_size"]
    q = BENCH_MODEL["num_heads"] * h // BENCH_MODEL["num_heads"]
    kv = BENCH_MODEL["num_kv_heads"] * h // BENCH_MODEL["num_heads"]
    shapes = ((q + 2 * kv, h), (h, q), (2 * inter, h), (h, inter))
    weights = [torch.randn(n, k) for n, k in shapes]
    packed = [cpu.prepare_linear(w) for w in weights]
    rows = []
    for m in LINEAR_ROWS:
        xs = [torch.randn(m, k) for _, k in shapes]
        dense = lambda: [F.linear(x, w) for x, w in zip(xs, weights)]  # noqa: E731
        fast = lambda: [cpu.linear(x, p, None) for x, p in zip(xs, packed)]  # noqa: E731
        ref_ms, cpu_ms = medians_ms([dense, fast], args.warmup, args.iters)
        rows.append(dict(rows=m, ref_ms=ref_ms, cpu_ms=cpu_ms, speedup=ref_ms / cpu_ms))
    return rows


def bench_attention(ref, cpu, args) -> list[dict]:
    heads, kv_heads = BENCH_MODEL["num_heads"], BENCH_MODEL["num_kv_heads"]
    dim, block_size = BENCH_MODEL["hidden_size"] // heads, 16
    out = []
    for batch, ctx in ATTENTION_SHAPES:
        per_seq = -(-ctx // block_size)
        k_cache = torch.randn(batch * per_seq, block_size, kv_heads, dim)
        v_cache = torch.randn_like(k_cache)
        tables = torch.randperm(batch * per_seq).view(batch, per_seq).to(torch.int32)
        meta = DecodeMetadata(torch.full((batch,), ctx, dtype=torch.int32), tables, [ctx] * batch)
        query = torch.randn(batch, heads, dim)
        err = (ref.decode(query, k_cache, v_cache, meta, dim ** -0.5)
               - cpu.decode(query, k_cache, v_cache, meta, dim ** -0.5)).abs().max().item()
        ref_ms, cpu_ms = medians_ms([lambda: ref.decode(query, k_cache, v_cache, meta, dim ** -0.5),
                                     lambda: cpu.decode(query, k_cache, v_cache, meta, dim ** -0.5)],
                                    args.warmup, args.iters)
        out.append(dict(batch=batch, context=ctx, ref_ms=ref_ms, cpu_ms=cpu_ms,
                        speedup=ref_ms / cpu_ms, max_abs_diff=err))
    return out


def engine_at(model: str, backend: str, batch: int, ctx: int) -> LLMEngine:
    engine = LLMEngine(EngineConfig.from_kwargs(model, kernel_backend=backend, max_model_len=4096,
                                                kv_cache_memory=1 << 29))
    for i in range(batch):
        engine.add_request(f"r{i}", [(7 * i + j) % 600 + 1 for j in range(ctx)],
                           SamplingParams(max_tokens=1000, ignore_eos=True, temperature=0))
    while engine.scheduler.waiting or any(s.num_computed_tokens < ctx for s in engine.scheduler.running):
        engine.step()
    return engine


def copy_bandwidth_gb_s(args) -> float:
    src = torch.empty(1 << 28)   # 1 GiB of float32, touched
    src.fill_(1.0)
    dst = torch.empty_like(src)
    dst.fill_(0.0)
    (ms,) = medians_ms([lambda: dst.copy_(src)], 1, max(3, args.iters // 3))
    return src.numel() * 4 / ms / 1e6


def bench_steps(model: str, args) -> tuple[list[dict], dict]:
    out = []
    for batch, ctx in STEP_SHAPES:
        engines = [engine_at(model, "ref", batch, ctx), engine_at(model, "cpu", batch, ctx)]
        ref_ms, cpu_ms = medians_ms([engines[0].step, engines[1].step], 2, args.iters)
        out.append(dict(batch=batch, context=ctx, ref_ms=ref_ms, cpu_ms=cpu_ms, speedup=ref_ms / cpu_ms))
        lm = engines[1].model     # weights read per step: an untied embedding is gathered by row
        weight_bytes = sum(size for name, size in lm.dense_bytes.items()
                           if name != "embed.weight" or lm.cfg.tie_word_embeddings)
        del engines
    bandwidth = copy_bandwidth_gb_s(args)
    floor_ms = weight_bytes / bandwidth / 1e6
    batch1 = out[0]
    floor = dict(weight_bytes=weight_bytes, copy_gb_s=bandwidth, floor_ms=floor_ms,
                 ref_over_floor=batch1["ref_ms"] / floor_ms, cpu_over_floor=batch1["cpu_ms"] / floor_ms)
    return out, floor


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--out", default="bench/results/cpu_backend.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = str(ensure_bench_model())
    ref, cpu = get_backend("ref", "cpu"), get_backend("cpu", "cpu")
    if getattr(cpu, "extension", None) is None:
        print("the C++ decode is not built: attention figures are ref against ref")
    with torch.inference_mode():
        linear = bench_linear(ref, cpu, args)
        attention = bench_attention(ref, cpu, args)
    steps, floor = bench_steps(model, args)
    result = dict(command="python bench/cpu_backend.py " + " ".join(argv or sys.argv[1:]),
                  machine=machine_info(), torch=torch.__version__, threads=args.threads,
                  linear=linear, attention=attention, steps=steps, batch1_floor=floor)
    print(f"threads={args.threads}  (ref / cpu, median ms)")
    for r in linear:
        print(f"linear  rows {r['rows']:>4}: ref {r['ref_ms']:7.2f}  cpu {r['cpu_ms']:7.2f}  x{r['speedup']:.2f}")
    for r in attention:
        print(f"decode attention {r['batch']:>2} x {r['context']:>4}: ref {r['ref_ms']:7.2f}  "
              f"cpu {r['cpu_ms']:7.2f}  x{r['speedup']:.2f}  max|diff| {r['max_abs_diff']:.1e}")
    for r in steps:
        print(f"engine step {r['batch']:>2} x {r['context']:>4}: ref {r['ref_ms']:7.2f}  "
              f"cpu {r['cpu_ms']:7.2f}  x{r['speedup']:.2f}")
    print(f"batch-1 floor {floor['floor_ms']:.1f} ms ({floor['weight_bytes'] / 1e6:.0f} MB at "
          f"{floor['copy_gb_s']:.1f} GB/s): ref {floor['ref_over_floor']:.2f}x, cpu {floor['cpu_over_floor']:.2f}x")
    ok = floor["cpu_over_floor"] <= 1.3 and all(r["speedup"] >= 1.0 for r in steps[1:])
    return write_result(args.out, result, ok)


if __name__ == "__main__":
    sys.exit(main())
