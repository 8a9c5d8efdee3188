"""Accuracy anchor: the perplexity of a model on a text by pdmesh's engine (`pdmesh eval`)
and by transformers on the same weights, tokens and windows (Hugging Face's sliding-window
recipe, services/eval/windows.py), side by side.

    python bench/eval_ppl.py [--model smollm2] [--text /usr/share/common-licenses/GPL-3]
                             [--window 512] [--stride 256] [--out bench/results/eval_ppl.json]

Writes the JSON of `pdmesh eval` plus transformers' nll and ppl and their ratio.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
from bench_model import ROOT, model_folder

from services.bench.machine import machine_info  # noqa: E402
from services.cli import main as pdmesh  # noqa: E402
from services.eval.windows import sliding_windows  # noqa: E402


@torch.inference_mode()
def transformers_ppl(model_dir: Path, ids: list[int], window: int, stride: int) -> dict:
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    start, total, scored = time.perf_counter(), 0.0, 0
    for w in sliding_windows(len(ids), window, stride):
        logp = model(torch.tensor([ids[w.begin:w.end]])).logits[0].float().log_softmax(dim=-1)
        targets = torch.arange(w.first_scored, w.end)
        total -= float(logp[targets - w.begin - 1, torch.tensor(ids)[targets]].double().sum())
        scored += len(targets)
    return {"nll": total / scored, "ppl": math.exp(total / scored), "scored": scored,
            "version": transformers.__version__, "seconds": time.perf_counter() - start}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="smollm2 (pulled on first use) or a model folder")
    ap.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--stride", type=int, default=256)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "eval_ppl.json"))
    args = ap.parse_args()
    model = model_folder(args.model)
    ours_path = Path(args.out).with_suffix(".engine.json")
    code = pdmesh(["eval", "--model", str(model), "--text", args.text, "--window", str(args.window),
                   "--stride", str(args.stride), "--json", str(ours_path)])
    if code != 0:
        return code
    ours = json.loads(ours_path.read_text())
    ours_path.unlink()
    from common.model.tokenizer import Tokenizer
    ids = Tokenizer.from_dir(model).encode(Path(args.text).read_text())
    ref = transformers_ppl(model, ids, args.window, args.stride)
    assert ref["scored"] == ours["scored"], (ref["scored"], ours["scored"])
    report = {"command": " ".join(["python", "bench/eval_ppl.py", *sys.argv[1:]]), "machine": machine_info(),
              "pdmesh": ours, "transformers": ref, "ppl_ratio": ours["ppl"] / ref["ppl"]}
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"perplexity of {model.name} on {args.text} (window {args.window}, stride {args.stride}, "
          f"{ours['scored']} tokens): pdmesh {ours['ppl']:.6f}, transformers {ref['ppl']:.6f}, "
          f"ratio {report['ppl_ratio']:.8f}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
