"""`pdmesh make-tiny-model`: write a tiny random HF checkpoint (common.model.tiny)."""
from __future__ import annotations

import argparse
import sys


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "make-tiny-model",
        help="write a tiny random Llama/Qwen2/Qwen3/Qwen3-MoE model folder (HF format)",
        description="Write a deterministic tiny random model: config.json, model.safetensors, tokenizer files.",
    )
    p.add_argument("--arch", required=True, choices=["llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3"])
    p.add_argument("--out", required=True, help="output folder (created)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--num-heads", type=int, default=8)
    p.add_argument("--num-kv-heads", type=int, default=4)
    p.add_argument("--intermediate-size", type=int, default=None, help="default: 2.75 x hidden, rounded to 64")
    p.add_argument("--head-dim", type=int, default=None, help="default: hidden / heads")
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--max-position-embeddings", type=int, default=4096)
    p.add_argument("--rope-theta", type=float, default=10000.0)
    tie = p.add_mutually_exclusive_group()
    tie.add_argument("--tie-word-embeddings", dest="tie_word_embeddings", action="store_true", default=None)
    tie.add_argument("--no-tie-word-embeddings", dest="tie_word_embeddings", action="store_false")
    p.add_argument("--num-experts", type=int, default=None, help="qwen3_moe, deepseek_v3: experts per layer (default 8)")
    p.add_argument("--num-experts-per-tok", type=int, default=None, help="qwen3_moe, deepseek_v3: experts a token goes to (default 2)")
    p.add_argument("--max-shard-bytes", type=int, default=None, help="split weights into HF shards of this size")
    p.add_argument("--if-missing", action="store_true", help="do nothing when OUT/config.json exists")
    return p


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from common.model.tiny import make_tiny_model

    if args.if_missing and (Path(args.out) / "config.json").exists():
        print(f"{args.out} already has a model; nothing to do")
        return 0
    try:
        out = make_tiny_model(
            args.arch, args.out, args.seed,
            hidden_size=args.hidden_size, num_layers=args.num_layers, num_heads=args.num_heads,
            num_kv_heads=args.num_kv_heads, intermediate_size=args.intermediate_size,
            head_dim=args.head_dim, vocab_size=args.vocab_size,
            max_position_embeddings=args.max_position_embeddings, rope_theta=args.rope_theta,
            tie_word_embeddings=args.tie_word_embeddings, max_shard_bytes=args.max_shard_bytes,
            num_experts=args.num_experts, num_experts_per_tok=args.num_experts_per_tok,
        )
    except ValueError as e:
        print(f"pdmesh make-tiny-model: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote tiny {args.arch} model (seed {args.seed}) to {out}")
    for path in sorted(out.iterdir()):
        if path.is_file():
            print(f"  {path.name:40s} {path.stat().st_size:>12,d} bytes")
    return 0
