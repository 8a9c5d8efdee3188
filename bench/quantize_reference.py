"""Is pdmesh's quantized inference the scheme's math? For each checkpoint `pdmesh quantize`
writes from SmolLM2-135M-Instruct: `pdmesh eval` perplexity (the engine in float32, cpu
backend) against a float64 reference on the same weights and the same windows, and for
W4A16 greedy tokens against the reference's.

The references are the tests' independent implementations (transformers' model in float64,
each projection computing the scheme from the checkpoint's own tensors:
tests/quant_checkpoints.py, tests/msmodelslim_checkpoints.py, tests/c8_checkpoints.py), not
pdmesh's kernels. Target (issue 28): within 0.5% of the reference's perplexity; W4A16
tokens equal. Beside it, the same reference run in float32: how far float32 rounding alone
moves each scheme's perplexity (W8A8's rounding decisions flip under it).

    python bench/quantize_reference.py [--model smollm2] [--schemes w8a8-dynamic:compressed-tensors,...]
        [--max-tokens 0] [--greedy-prompts 4] [--greedy-tokens 32] [--nudged-runs 0]
        [--out bench/results/quantize_reference.json]

A scheme name ending ":minmax" quantizes static activations over the calibration's min/max
(`--static-range minmax`) instead of the searched clip. --nudged-runs N: N more engine runs
of each checkpoint with its embedding table moved by one float32 step at random (seeded;
a third of the entries up, a third down): how far float32 inference of the same scheme
spreads by rounding alone, beside how far it sits from the float64 reference.

--max-tokens: only the first N tokens of GPL-3 scored by both (float64 transformers is the
slow side: about 2 minutes a scheme for the whole text on 2 cores); 0 = the whole text
(7,639 tokens, 29 windows of 512 every 256, as `pdmesh eval --text gpl-3`).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_model import ROOT, model_folder
from safetensors.torch import load_file, save_file

from common.engine import LLM, SamplingParams  # noqa: E402
from services.bench.machine import machine_info  # noqa: E402
from services.cli import main as pdmesh  # noqa: E402
from services.eval.perplexity import perplexity  # noqa: E402
from services.eval.scorers import EngineScorer  # noqa: E402
from tests.c8_checkpoints import c8_reference, patched  # noqa: E402
from tests.msmodelslim_checkpoints import reference_model as modelslim_reference  # noqa: E402
from tests.quant_checkpoints import w4a16_reference_model, w8a8_reference_model  # noqa: E402

GROUP_SIZE = 64            # 576 is not a multiple of 128
CALIBRATION = ("Apache-2.0", "MPL-2.0", "Artistic", "CC0-1.0", "BSD")     # none of the GPL family
SCHEMES = {   # name (":gptq": --method gptq) -> (pdmesh quantize --scheme, --format, float64 reference of the folder)
    "w8a8-dynamic:compressed-tensors": ("w8a8-dynamic", "compressed-tensors",
                                        lambda q: w8a8_reference_model(q, divisor=127.5)),
    "w8a8-dynamic:modelslim": ("w8a8-dynamic", "modelslim", lambda q: modelslim_reference(q, "dynamic")),
    "w8a8:modelslim": ("w8a8", "modelslim", lambda q: modelslim_reference(q, "static")),
    "w8a8:modelslim:minmax": ("w8a8", "modelslim", lambda q: modelslim_reference(q, "static")),
    "w4a16:compressed-tensors": ("w4a16", "compressed-tensors", lambda q: w4a16_reference_model(q, GROUP_SIZE)),
    "w4a16:compressed-tensors:gptq": ("w4a16", "compressed-tensors", lambda q: w4a16_reference_model(q, GROUP_SIZE)),
    "c8:modelslim": ("c8", "modelslim", c8_reference),
}
GREEDY = ("w4a16:compressed-tensors", "w4a16:compressed-tensors:gptq")   # token-stable (fp32 and float64 agree)


class ReferenceScorer:
    """services/eval's scorer interface over a float64 transformers model."""

    def __init__(self, model, max_window: int):
        self.model, self.max_window = model, max_window

    def score(self, windows: list[list[int]]) -> list[list[float]]:
        rows = []
        with torch.no_grad():
            for w in windows:
                ids = torch.tensor([w])
                logp = torch.log_softmax(self.model(ids).logits[0, :-1].double(), -1)
                rows.append(logp.gather(1, ids[0, 1:, None])[:, 0].tolist())
        return rows


def greedy64(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def nudged_copy(folder: Path, out: Path, seed: int) -> Path:
    """folder copied to out with model.embed_tokens.weight moved one float32 step up or down
    at random (seeded), stored as float32."""
    shutil.copytree(folder, out)
    for f in out.glob("*.safetensors"):
        tensors = load_file(f)
        if "model.embed_tokens.weight" in tensors:
            e = tensors["model.embed_tokens.weight"].float()
            way = torch.randint(-1, 2, e.shape, generator=torch.Generator().manual_seed(seed))
            up, down = torch.nextafter(e, torch.tensor(float("inf"))), torch.nextafter(e, torch.tensor(float("-inf")))
            tensors["model.embed_tokens.weight"] = torch.where(way > 0, up, torch.where(way < 0, down, e))
            save_file(tensors, str(f), metadata={"format": "pt"})
            return out
    raise SystemExit(f"{folder}: no model.embed_tokens.weight to nudge")


def engine_ppl(folder: Path, ids: list[int], args) -> float:
    with LLM(str(folder), kernel_backend="cpu", dtype="float32") as llm:
        return perplexity(ids, args.window, args.stride, EngineScorer(llm)).ppl


def reference_context(name: str, model):
    return patched(model) if name.startswith("c8") else contextlib.nullcontext()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--schemes", default=",".join(SCHEMES))
    ap.add_argument("--max-tokens", type=int, default=0)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--stride", type=int, default=256)
    ap.add_argument("--greedy-prompts", type=int, default=4)
    ap.add_argument("--greedy-tokens", type=int, default=32)
    ap.add_argument("--nudged-runs", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "quantize_reference.json"))
    args = ap.parse_args()
    names = [n for n in args.schemes.split(",") if n]
    unknown = [n for n in names if n not in SCHEMES]
    if unknown:
        raise SystemExit(f"--schemes: unknown {unknown}; allowed: {', '.join(SCHEMES)}")
    model = model_folder(args.model)
    work = Path(tempfile.mkdtemp(prefix="pdmesh-quant-ref-"))
    calib = work / "calibration.txt"
    calib.write_text("\n\n".join(Path("/usr/share/common-licenses", n).read_text() for n in CALIBRATION))
    text = Path("/usr/share/common-licenses/GPL-3").read_text()
    report = {"command": " ".join(["python", "bench/quantize_reference.py", *sys.argv[1:]]),
              "machine": machine_info(), "model": str(model), "text": "/usr/share/common-licenses/GPL-3",
              "max_tokens": args.max_tokens, "window": args.window, "stride": args.stride, "runs": []}
    try:
        for name in names:
            scheme, fmt, reference = SCHEMES[name]
            method = "gptq" if name.endswith(":gptq") else "rtn"
            out = work / name.replace(":", "-")
            quantize = ["quantize", str(model), "--scheme", scheme, "--format", fmt, "--calib", str(calib),
                        "--group-size", str(GROUP_SIZE), "--method", method, "--out", str(out)]
            if name.endswith(":minmax"):
                quantize += ["--static-range", "minmax"]
            if pdmesh(quantize) != 0:
                raise SystemExit(f"pdmesh {' '.join(quantize)} failed")
            start = time.perf_counter()
            with LLM(str(out), kernel_backend="cpu", dtype="float32") as llm:
                scorer = EngineScorer(llm)
                ids = scorer.encode(text).token_ids
                ids = ids[:args.max_tokens] if args.max_tokens else ids
                ours = perplexity(ids, args.window, args.stride, scorer)
                prompts = [ids[i * 97:i * 97 + 24] for i in range(args.greedy_prompts)]
                greedy = SamplingParams(max_tokens=args.greedy_tokens, temperature=0.0, ignore_eos=True)
                our_tokens = ([list(o.outputs[0].token_ids) for o in
                               llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)]
                              if name in GREEDY else [])
                max_window = llm.engine.max_model_len - 1
            engine_s = time.perf_counter() - start
            nudged = [engine_ppl(nudged_copy(out, work / f"nudged-{seed}", seed), ids, args)
                      for seed in range(args.nudged_runs)]
            for seed in range(args.nudged_runs):
                shutil.rmtree(work / f"nudged-{seed}")
            start = time.perf_counter()
            ref_model = reference(out)
            with reference_context(name, ref_model):
                ref = perplexity(ids, args.window, args.stride, ReferenceScorer(ref_model, max_window))
                ref_tokens = [greedy64(ref_model, p, args.greedy_tokens) for p in prompts] if our_tokens else []
                # the same reference in float32: how far float32 rounding alone moves this scheme
                ref32 = perplexity(ids, args.window, args.stride, ReferenceScorer(ref_model.float(), max_window))
            reference_s = time.perf_counter() - start
            run = {"scheme": name, "quantize_command": "pdmesh " + " ".join(quantize),
                   "ppl": ours.ppl, "reference_ppl": ref.ppl, "ppl_diff": ours.ppl / ref.ppl - 1,
                   "reference_fp32_ppl": ref32.ppl, "reference_fp32_diff": ref32.ppl / ref.ppl - 1,
                   "scored": ours.scored, "num_windows": ours.num_windows,
                   "engine_seconds": engine_s, "reference_seconds": reference_s}
            if nudged:
                run["nudged_ppls"] = nudged
                run["nudged_diffs"] = [p / ref.ppl - 1 for p in nudged]
            if our_tokens:
                run["greedy_tokens_equal"] = our_tokens == ref_tokens
                run["greedy_positions_equal"] = sum(a == b for x, y in zip(our_tokens, ref_tokens)
                                                    for a, b in zip(x, y))
                run["greedy_positions"] = sum(len(x) for x in ref_tokens)
            report["runs"].append(run)
            tokens = (f"; greedy tokens {run['greedy_positions_equal']}/{run['greedy_positions']} equal"
                      if our_tokens else "")
            print(f"{name:34s} pdmesh eval {ours.ppl:.4f}, float64 reference {ref.ppl:.4f} "
                  f"({100 * run['ppl_diff']:+.3f}%; the reference in float32 {ref32.ppl:.4f}, "
                  f"{100 * run['reference_fp32_diff']:+.3f}%){tokens}", flush=True)
            if nudged:
                print(f"{'':34s} nudged embeddings: {', '.join(f'{100 * d:+.3f}%' for d in run['nudged_diffs'])}",
                      flush=True)
            shutil.rmtree(out, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
