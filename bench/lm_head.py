"""A tied LM head on the cpu backend: its own oneDNN-packed copy (what the engine does)
against the dense matrix through F.linear (what it did before), on SmolLM2-135M-Instruct
(tied, vocab 49152 x hidden 576, a fifth of its weights), in one engine, alternating.

    python bench/lm_head.py [--rounds 3] [--batch 2] [--steps 64] [--out bench/results/lm_head.json]

Measures decode milliseconds per step: `batch` sequences of 200 prompt tokens, `steps`
tokens each, greedy; the first run of each variant is a warm-up. Also the share of a
step spent in the head, from the same timings (the dense variant's step minus the packed
one's, over the dense one's).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from bench_model import ROOT

from common.engine import LLM, SamplingParams  # noqa: E402
from services.bench.machine import machine_info  # noqa: E402


def step_ms(llm: LLM, batch: int, steps: int) -> float:
    prompts = [{"prompt_token_ids": list(range(100 + i, 300 + i))} for i in range(batch)]
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    llm.engine.block_manager.reset_prefix_cache()
    start = time.perf_counter()
    llm.generate(prompts, params)
    return (time.perf_counter() - start) / steps * 1000


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "lm_head.json"))
    args = ap.parse_args()
    from common.model.catalog import pull_model
    llm = LLM(str(pull_model("smollm2-135m-instruct", ROOT / "models")), num_blocks=512, max_num_seqs=8)
    model = llm.engine.model
    head_layer = model.lm_head
    packed, dense = head_layer.prepared, model.embed.weight.data   # .data: a plain tensor, not a Parameter
    assert packed is not dense, "the backend keeps a tied head dense: nothing to compare"
    times: dict[str, list[float]] = {"packed": [], "dense": []}
    for variant, head in (("packed", packed), ("dense", dense)):   # warm-up
        head_layer.prepared = head
        step_ms(llm, args.batch, args.steps)
    for _ in range(args.rounds):
        for variant, head in (("packed", packed), ("dense", dense)):
            head_layer.prepared = head
            times[variant].append(step_ms(llm, args.batch, args.steps))
    head_layer.prepared = packed
    med = {k: statistics.median(v) for k, v in times.items()}
    report = {"command": " ".join(["python", "bench/lm_head.py", *sys.argv[1:]]), "machine": machine_info(),
              "batch": args.batch, "steps": args.steps, "ms_per_step": times, "median_ms_per_step": med,
              "speedup": med["dense"] / med["packed"], "head_share_dense": (med["dense"] - med["packed"]) / med["dense"]}
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"decode ms/step, {args.batch} sequences: packed head {med['packed']:.1f}, dense head {med['dense']:.1f} "
          f"({report['speedup']:.2f}x); wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
