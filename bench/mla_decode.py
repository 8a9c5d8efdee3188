"""MLA (DeepSeek's latent attention, common/model/layers/mla.py) on the CPU: a decode step's
attention absorbed over the latent cache against the same attention expanded per head, and
the KV bytes a token costs in the latent cache against a per-head K/V cache.

    python bench/mla_decode.py [--batch 16] [--context 1024] [--rounds 5] [--out bench/results/mla_decode.json]

Attention: one layer of DeepSeek-V2-Lite's shape (16 heads, kv_lora_rank 512, rope 64,
qk_nope 128, v_head 128; fp32), `batch` sequences of `context` cached tokens each, one new
query token each, from the query (after q_b_proj) to the per-head output (before o_proj):
    absorbed   q_nope through W_UK, attention over the latent rows as one KV head, the
               output through W_UV (Backend.mla_decode). On the cpu backend: each sequence's
               blocks consecutive in the cache, so two GEMMs a sequence over its rows in place
               (kernels/mla_cpu_decode.py); `scattered`: the same cache with the block table
               shuffled, which the cpu backend runs on the C++ paged decode kernel (the
               latent as one KV head); on ref, torch's tiled gather
    expanded   every sequence's latent rows recomputed through kv_b_proj into per-head K
               and V, then attention per head (what the layer's prefill does; a decode that
               keeps only the latent and does not absorb must do it every step)
    per-head   attention over a per-head K/V cache (what caching K and V instead of the
               latent would read: 16 heads x 192 a token for K, V padded from 128 to 192 as
               one paged decode call needs, so its V work is overstated by half), the same
               C++ kernel
Times alternate A/B within each round; per round the median of `steps` calls; the ratio
per round, then its median.

KV bytes a token: num_layers x (kv_lora_rank + rope) x itemsize (latent) against num_layers
x heads x (qk_nope + rope + v_head) x itemsize (per head), for the tiny DeepSeek-V3 of
`pdmesh make-tiny-model --arch deepseek_v3` (read from its engine's published KV layout),
DeepSeek-V2-Lite and DeepSeek-V3 (from their configs' sizes, bf16). The pushed bytes equal
the latent formula exactly: tests/integration/test_mla_mesh.py asserts the prefill node's
transfer counter against it.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_model import ROOT

from common.engine import LLM  # noqa: E402
from common.kv_layout import KVLayout  # noqa: E402
from common.model.config import model_config_from_dict  # noqa: E402
from common.model.layers.mla import MLAAttention  # noqa: E402
from common.model.layers.quant_config import FloatConfig  # noqa: E402
from common.model.tiny import make_tiny_model  # noqa: E402
from common.parallel.shard import whole_model  # noqa: E402
from kernels import DecodeMetadata, PrefillMetadata, get_backend  # noqa: E402
from services.bench.machine import machine_info  # noqa: E402

V2_LITE = dict(architectures=["DeepseekV2ForCausalLM"], vocab_size=102400, hidden_size=2048, intermediate_size=10944,
               num_hidden_layers=27, num_attention_heads=16, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
               qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2,
               moe_intermediate_size=1408, first_k_dense_replace=1)
V3_SIZES = dict(num_layers=61, heads=128, kv_lora_rank=512, rope=64, nope=128, v=128)   # DeepSeek-V3's config.json
BLOCK = 16


def attention_layer(backend_name: str):
    cfg = model_config_from_dict(V2_LITE)
    layer = MLAAttention(cfg, whole_model(cfg), FloatConfig(), "model.layers.1.self_attn.", torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    layer.absorb()
    backend = get_backend(backend_name, torch.device("cpu"))
    for linear in (layer.down, layer.q_up, layer.kv_b, layer.o):
        linear.prepare(backend)
    return cfg, layer, backend


def per_head_caches(cfg, batch: int, context: int):
    """K and V caches of every head [blocks, BLOCK, heads, qk_head_dim] (V padded) and a
    query of that width."""
    g = torch.Generator().manual_seed(2)
    blocks, width = batch * -(-context // BLOCK), cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    k = torch.randn(blocks, BLOCK, cfg.num_heads, width, generator=g)
    v = torch.randn(blocks, BLOCK, cfg.num_heads, width, generator=g)
    return k, v, torch.randn(batch, cfg.num_heads, width, generator=g)


def inputs(cfg, batch: int, context: int):
    g = torch.Generator().manual_seed(1)
    blocks = -(-context // BLOCK)
    cache = torch.randn(batch * blocks, BLOCK, 1, cfg.kv_lora_rank + cfg.qk_rope_head_dim, generator=g)
    tables = torch.arange(batch * blocks, dtype=torch.int32).view(batch, blocks)
    q_nope = torch.randn(batch, cfg.num_heads, cfg.qk_nope_head_dim, generator=g)
    q_pe = torch.randn(batch, cfg.num_heads, cfg.qk_rope_head_dim, generator=g)
    lens = [context] * batch
    decode = DecodeMetadata(seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=tables, seq_lens_list=lens)
    prefill = PrefillMetadata(query_start_loc=torch.arange(batch + 1, dtype=torch.int32),
                              seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=tables,
                              query_lens_list=[1] * batch, seq_lens_list=lens)
    return cache, q_nope, q_pe, decode, prefill


class _Batch:        # what MLAAttention._decode reads of a StepBatch
    def __init__(self, decode):
        self.decode = decode


def timed(fn, steps: int) -> float:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def attention(batch: int, context: int, rounds: int, steps: int) -> dict:
    cfg, layer, cpu = attention_layer("cpu")
    ref = get_backend("ref", torch.device("cpu"))
    cache, q_nope, q_pe, decode, prefill = inputs(cfg, batch, context)
    k_heads, v_heads, q_heads = per_head_caches(cfg, batch, context)
    shuffled = torch.randperm(decode.block_tables.numel(), generator=torch.Generator().manual_seed(3))
    scattered = DecodeMetadata(seq_lens=decode.seq_lens, seq_lens_list=decode.seq_lens_list,
                               block_tables=shuffled.view_as(decode.block_tables).to(torch.int32))
    runs = {
        "absorbed_cpu": lambda: layer._decode(q_nope, q_pe, (cache,), _Batch(decode), cpu),
        "absorbed_cpu_scattered": lambda: layer._decode(q_nope, q_pe, (cache,), _Batch(scattered), cpu),
        "absorbed_ref": lambda: layer._decode(q_nope, q_pe, (cache,), _Batch(decode), ref),
        "expanded": lambda: layer._prefill(q_nope, q_pe, None, (cache,), prefill, cpu),
        "per_head_cache": lambda: cpu.decode(q_heads, k_heads, v_heads, decode, layer.scale),
    }
    with torch.inference_mode():
        a, r, e = (runs[k]() for k in ("absorbed_cpu", "absorbed_ref", "expanded"))
        agree = max((a - e).abs().max().item(), (r - e).abs().max().item())
        per_round = {k: [] for k in runs}
        for i in range(rounds):
            order = list(runs) if i % 2 == 0 else list(reversed(runs))
            for k in order:
                per_round[k].append(timed(runs[k], steps))
    ratio = statistics.median(a / e for a, e in zip(per_round["absorbed_cpu"], per_round["expanded"]))
    ref_ratio = statistics.median(a / r for a, r in zip(per_round["absorbed_cpu"], per_round["absorbed_ref"]))
    head_ratio = statistics.median(a / h for a, h in zip(per_round["absorbed_cpu"], per_round["per_head_cache"]))
    gemm_ratio = statistics.median(g / a for g, a in zip(per_round["absorbed_cpu"],
                                                         per_round["absorbed_cpu_scattered"]))
    return {"batch": batch, "context": context, "rounds": rounds, "steps": steps,
            "ms": {k: round(statistics.median(v) * 1e3, 3) for k, v in per_round.items()},
            "absorbed_over_expanded": round(ratio, 4), "absorbed_cpu_over_ref": round(ref_ratio, 3),
            "absorbed_over_per_head_cache": round(head_ratio, 3), "gemm_over_paged_kernel": round(gemm_ratio, 3),
            "max_abs_diff": agree}


def per_token_bytes(num_layers, heads, kv_lora_rank, rope, nope, v, itemsize) -> dict:
    latent = num_layers * (kv_lora_rank + rope) * itemsize
    per_head = num_layers * heads * (nope + rope + v) * itemsize
    return {"latent": latent, "per_head": per_head, "per_head_over_latent": round(per_head / latent, 2)}


def kv_bytes() -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_tiny_model("deepseek_v3", Path(tmp) / "ds")
        with LLM(str(folder), kernel_backend="cpu", num_blocks=16) as llm:
            cfg, lay = llm.engine.model_config, KVLayout.of_tensor(llm.engine.kv_cache)
            measured = lay.num_layers * lay.planes * lay.block_bytes // lay.block_size
            tiny = per_token_bytes(cfg.num_layers, cfg.num_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim,
                                   cfg.qk_nope_head_dim, cfg.v_head_dim, 4)
    lite = model_config_from_dict(V2_LITE)
    return {"tiny_deepseek_v3_fp32": {**tiny, "from_engine_layout": measured},
            "deepseek_v2_lite_bf16": per_token_bytes(lite.num_layers, lite.num_heads, lite.kv_lora_rank,
                                                     lite.qk_rope_head_dim, lite.qk_nope_head_dim, lite.v_head_dim, 2),
            "deepseek_v3_bf16": per_token_bytes(*V3_SIZES.values(), 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "mla_decode.json"))
    args = ap.parse_args()
    result = {"command": "python " + " ".join(sys.argv), "machine": machine_info(),
              "attention": attention(args.batch, args.context, args.rounds, args.steps), "kv_bytes_per_token": kv_bytes()}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    att = result["attention"]
    print(f"decode attention, batch {att['batch']}, context {att['context']} (DeepSeek-V2-Lite layer, fp32): "
          f"absorbed {att['ms']['absorbed_cpu']} ms (GEMMs; scattered blocks on the paged kernel "
          f"{att['ms']['absorbed_cpu_scattered']} ms: {att['gemm_over_paged_kernel']}x; ref backend "
          f"{att['ms']['absorbed_ref']} ms), expanded "
          f"{att['ms']['expanded']} ms, per-head cache {att['ms']['per_head_cache']} ms -> absorbed/expanded "
          f"{att['absorbed_over_expanded']}x, absorbed/per-head {att['absorbed_over_per_head_cache']}x, cpu/ref "
          f"{att['absorbed_cpu_over_ref']}x; outputs agree to {att['max_abs_diff']:.1e}")
    for name, b in result["kv_bytes_per_token"].items():
        print(f"KV bytes a token, {name}: latent {b['latent']}, per head {b['per_head']} "
              f"({b['per_head_over_latent']}x)" + (f"; engine layout {b['from_engine_layout']}"
                                                   if "from_engine_layout" in b else ""))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
