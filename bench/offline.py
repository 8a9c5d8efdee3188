"""Offline throughput: pdmesh's engine against transformers `generate`, same run, alternating.

Workload (seeded): 24 requests, prompts 16-384 tokens, outputs 8-96 tokens, greedy,
ignore_eos, on a Llama of hidden 1024, 8 layers, 16 heads, 4 KV heads, fp32 (made by the
tiny maker, ~90M parameters). transformers runs static batches of 8 with left padding;
its tokens/s counts only the tokens each request asked for.

Also: the batch-1 decode step time against the floor  weight bytes read per step /
memory-copy bandwidth, both measured in this run.

    python bench/offline.py [--rounds 2] [--out bench/results/offline.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path

import torch

from bench_model import BENCH_MODEL, DEFAULT_DIR, ROOT, ensure_bench_model

from common.engine import LLM, SamplingParams  # noqa: E402


def workload(seed: int, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(3, vocab) for _ in range(rng.randint(16, 384))], rng.randint(8, 96))
            for _ in range(24)]


def run_pdmesh(llm: LLM, reqs) -> float:
    prompts = [{"prompt_token_ids": p} for p, _ in reqs]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in reqs]
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outs] == [n for _, n in reqs]
    return elapsed


@torch.inference_mode()
def run_transformers(model, reqs, batch_size: int = 8) -> float:
    start = time.perf_counter()
    for i in range(0, len(reqs), batch_size):
        chunk = reqs[i:i + batch_size]
        width = max(len(p) for p, _ in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk])
        new = max(n for _, n in chunk)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, pad_token_id=0)
        assert out.shape[1] == width + new
    return time.perf_counter() - start


def memcpy_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return nbytes / min(times)


def decode_step_time(llm: LLM, vocab: int, steps: int = 64) -> float:
    engine = llm.engine
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    engine.add_request("b1", [random.Random(1).randrange(3, vocab) for _ in range(16)], params)
    engine.step()  # prefill
    times = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def weight_bytes_per_decode_step(llm: LLM) -> int:
    model = llm.engine.model   # dense_bytes: sizes before the backend packed the linears
    return sum(size for name, size in model.dense_bytes.items()
               if name != "embed.weight" or model.cfg.tie_word_embeddings)  # an untied table is gathered by row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model-dir", default=str(DEFAULT_DIR))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "offline.json"))
    ap.add_argument("--max-num-seqs", type=int, default=24)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = ap.parse_args()

    model_dir = ensure_bench_model(args.model_dir, seed=args.seed)
    import transformers
    print("loading both engines", flush=True)
    llm = LLM(str(model_dir), max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    vocab = BENCH_MODEL["vocab_size"]
    reqs = workload(args.seed, vocab)
    out_tokens = sum(n for _, n in reqs)
    run_pdmesh(llm, reqs[:2])  # warm-up
    ours, theirs = [], []
    for r in range(args.rounds):
        ours.append(run_pdmesh(llm, reqs))
        llm.engine.block_manager.reset_prefix_cache()
        theirs.append(run_transformers(hf, reqs))
        print(f"round {r + 1}: pdmesh {out_tokens / ours[-1]:.1f} tok/s, "
              f"transformers {out_tokens / theirs[-1]:.1f} tok/s", flush=True)
    step = decode_step_time(llm, vocab)
    bandwidth = memcpy_bandwidth()
    wbytes = weight_bytes_per_decode_step(llm)
    floor = wbytes / bandwidth
    result = {
        "machine": {"cpus": torch.get_num_threads(), "platform": platform.platform(),
                    "torch": torch.__version__},
        "workload": {"requests": len(reqs), "prompt_tokens": sum(len(p) for p, _ in reqs),
                     "output_tokens": out_tokens, "seed": args.seed},
        "pdmesh_tok_s": out_tokens / statistics.median(ours),
        "transformers_tok_s": out_tokens / statistics.median(theirs),
        "pdmesh_runs_s": ours, "transformers_runs_s": theirs,
        "decode_step_batch1_ms": step * 1e3,
        "weight_bytes_per_step": wbytes,
        "memcpy_gb_s": bandwidth / 1e9,
        "decode_floor_ms": floor * 1e3,
    }
    result["ratio"] = result["pdmesh_tok_s"] / result["transformers_tok_s"]
    result["decode_step_over_floor"] = step / floor
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"pdmesh {result['pdmesh_tok_s']:.1f} tok/s vs transformers "
          f"{result['transformers_tok_s']:.1f} tok/s: ratio {result['ratio']:.2f}x (target >= 1.6x)")
    print(f"batch-1 decode step {step * 1e3:.1f} ms vs floor {floor * 1e3:.1f} ms "
          f"({wbytes / 1e6:.0f} MB at {bandwidth / 1e9:.1f} GB/s): "
          f"{result['decode_step_over_floor']:.2f}x (target <= 1.5x)")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
