"""Paged attention of a kernel backend against dense SDPA over the same data.

    python bench/kernels.py [--device cpu|cuda] [--backend auto|ref|cuda|npu] [--out PATH]

Decode: batch x context, block sizes 16 and 128, blocks shuffled; dense SDPA reads
contiguous K/V [batch, kv_heads, context, head_dim] with enable_gqa. Prefill: seqs x tokens
with no cached prefix, against per-sequence causal SDPA. Reports the median of --iters runs
after --warmup runs (paged and SDPA alternating) and writes JSON to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kernels import DecodeMetadata, PrefillMetadata, get_backend  # noqa: E402


def _median_ms(fns, device: torch.device, warmup: int, iters: int) -> list[float]:
    """Median wall time of each fn in ms; runs alternate so a shared machine's load hits
    every fn alike."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    for _ in range(warmup):
        for fn in fns:
            fn()
    sync()
    times = [[] for _ in fns]
    for _ in range(iters):
        for fn, t in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            sync()
            t.append(time.perf_counter() - t0)
    return [statistics.median(t) * 1e3 for t in times]


def bench_decode(backend, args, block_size: int, device: torch.device) -> dict:
    batch, ctx = args.batch, args.context
    heads, kv_heads, dim = args.heads, args.kv_heads, args.head_dim
    dtype = getattr(torch, args.dtype)
    blocks_per_seq = -(-ctx // block_size)
    num_blocks = batch * blocks_per_seq
    k_dense = torch.randn(batch, kv_heads, ctx, dim, dtype=dtype, device=device)
    v_dense = torch.randn_like(k_dense)
    query = torch.randn(batch, heads, dim, dtype=dtype, device=device)
    block_tables = torch.randperm(num_blocks, device=device).view(batch, blocks_per_seq).to(torch.int32)
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, dim, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    pos = torch.arange(ctx, device=device)
    slots = (block_tables.long()[:, pos // block_size] * block_size + pos % block_size).reshape(-1)
    k_cache.view(-1, kv_heads, dim)[slots] = k_dense.transpose(1, 2).reshape(-1, kv_heads, dim)
    v_cache.view(-1, kv_heads, dim)[slots] = v_dense.transpose(1, 2).reshape(-1, kv_heads, dim)
    meta = DecodeMetadata(torch.full((batch,), ctx, dtype=torch.int32, device=device),
                          block_tables, [ctx] * batch)
    scale = dim ** -0.5
    q4 = query.view(batch, heads, 1, dim)
    paged = lambda: backend.decode(query, k_cache, v_cache, meta, scale)  # noqa: E731
    dense = lambda: F.scaled_dot_product_attention(  # noqa: E731
        q4, k_dense, v_dense, scale=scale, enable_gqa=True)
    err = (paged().float() - dense().view(batch, heads, dim).float()).abs().max().item()
    paged_ms, dense_ms = _median_ms([paged, dense], device, args.warmup, args.iters)
    kv_bytes = 2 * k_dense.numel() * k_dense.element_size()
    return dict(block_size=block_size, paged_ms=paged_ms, sdpa_ms=dense_ms,
                ratio=paged_ms / dense_ms, max_abs_err=err,
                paged_gb_s=kv_bytes / paged_ms / 1e6, sdpa_gb_s=kv_bytes / dense_ms / 1e6)


def bench_prefill(backend, args, device: torch.device) -> dict:
    seqs, tokens = args.prefill_seqs, args.prefill_tokens
    heads, kv_heads, dim = args.heads, args.kv_heads, args.head_dim
    dtype = getattr(torch, args.dtype)
    block_size = 128
    total = seqs * tokens
    query = torch.randn(total, heads, dim, dtype=dtype, device=device)
    key = torch.randn(total, kv_heads, dim, dtype=dtype, device=device)
    value = torch.randn_like(key)
    blocks_per_seq = -(-tokens // block_size)
    k_cache = torch.zeros(seqs * blocks_per_seq, block_size, kv_heads, dim, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    block_tables = torch.arange(seqs * blocks_per_seq, dtype=torch.int32, device=device).view(seqs, -1)
    meta = PrefillMetadata(torch.arange(0, total + 1, tokens, dtype=torch.int32, device=device),
                           torch.full((seqs,), tokens, dtype=torch.int32, device=device),
                           block_tables, [tokens] * seqs, [tokens] * seqs)
    scale = dim ** -0.5
    paged = lambda: backend.prefill(query, key, value, k_cache, v_cache, meta, scale)  # noqa: E731

    def dense():
        q = query.view(seqs, tokens, heads, dim).transpose(1, 2)
        k = key.view(seqs, tokens, kv_heads, dim).transpose(1, 2)
        v = value.view(seqs, tokens, kv_heads, dim).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)

    paged_ms, dense_ms = _median_ms([paged, dense], device, args.warmup, args.iters)
    return dict(seqs=seqs, tokens=tokens, paged_ms=paged_ms, sdpa_ms=dense_ms, ratio=paged_ms / dense_ms)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--backend", default="auto")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-sizes", type=int, nargs="+", default=[16, 128])
    p.add_argument("--prefill-seqs", type=int, default=4)
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=7)
    p.add_argument("--out", default="bench/results/kernels.json")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    backend = get_backend(args.backend, device)
    torch.manual_seed(0)
    with torch.inference_mode():
        decode = [bench_decode(backend, args, bs, device) for bs in args.block_sizes]
        prefill = bench_prefill(backend, args, device)
    result = dict(backend=backend.name, device=str(device), dtype=args.dtype,
                  torch=torch.__version__, threads=torch.get_num_threads(),
                  machine=platform.processor() or platform.machine(),
                  load_avg_1m=os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
                  shape=dict(batch=args.batch, context=args.context, heads=args.heads,
                             kv_heads=args.kv_heads, head_dim=args.head_dim),
                  decode=decode, prefill=prefill)
    print(f"backend={backend.name} device={device} dtype={args.dtype} threads={torch.get_num_threads()}")
    for d in decode:
        print(f"decode  B={args.batch} ctx={args.context} H={args.heads}/{args.kv_heads} "
              f"d={args.head_dim} block={d['block_size']:>3}: paged {d['paged_ms']:8.2f} ms "
              f"({d['paged_gb_s']:.1f} GB/s)  sdpa {d['sdpa_ms']:8.2f} ms ({d['sdpa_gb_s']:.1f} GB/s)  "
              f"ratio {d['ratio']:.2f}  max|err| {d['max_abs_err']:.1e}")
    print(f"prefill {prefill['seqs']}x{prefill['tokens']}: paged {prefill['paged_ms']:8.2f} ms  "
          f"sdpa {prefill['sdpa_ms']:8.2f} ms  ratio {prefill['ratio']:.2f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
