"""What each quantization scheme costs: `pdmesh quantize` (calibrated on other texts than
the one evaluated: the non-GPL licenses every Debian has, Apache-2.0, MPL-2.0, Artistic,
CC0-1.0 and BSD, about 8,000 tokens) then `pdmesh eval` perplexity on GPL-3 and next-token
agreement / KL against the float model, per scheme.

    python bench/quantize_accuracy.py [--model smollm2] [--schemes w8a8-dynamic:compressed-tensors,...]
        [--max-tokens 0] [--out bench/results/quantize_accuracy.json]

A scheme is SCHEME:FORMAT[:rtn|gptq][:nosmooth][:minmax][:int8-head] (minmax: static W8A8's
activation ranges from the calibration's min/max, `--static-range minmax`; int8-head: evaluated with
`--lm-head-quantization int8`; `float:-:int8-head` is the float model with only that). The
JSON holds every run's ppl, its change against the float model's, agreement and KL, the
commands and seconds.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench_model import ROOT, model_folder

from services.bench.machine import machine_info  # noqa: E402
from services.cli import main as pdmesh  # noqa: E402

DEFAULT_SCHEMES = ("w8a8-dynamic:compressed-tensors:rtn:nosmooth", "w8a8-dynamic:compressed-tensors",
                   "w8a8:modelslim:rtn:nosmooth", "w8a8:modelslim", "w4a16:compressed-tensors:rtn:nosmooth",
                   "w4a16:compressed-tensors:gptq", "c8:modelslim")
LICENSES = Path("/usr/share/common-licenses")
CALIBRATION = ("Apache-2.0", "MPL-2.0", "Artistic", "CC0-1.0", "BSD")     # none of the GPL family


def run(argv: list[str]) -> None:
    code = pdmesh(argv)
    if code != 0:
        raise SystemExit(f"pdmesh {' '.join(argv)} exited {code}")


def evaluate(model: Path, reference: Path | None, args, work: Path, head: str = "none") -> dict:
    out: dict = {}
    ppl_json = work / "ppl.json"
    argv = ["eval", "--model", str(model), "--text", "gpl-3", "--json", str(ppl_json), "--lm-head-quantization", head]
    if args.max_tokens:
        argv += ["--max-tokens", str(args.max_tokens)]
    run(argv)
    out["perplexity"] = json.loads(ppl_json.read_text())
    if reference is not None:
        agree_json = work / "agreement.json"
        run(["eval", "--model", str(model), "--reference", str(reference), "--num-prompts", str(args.num_prompts),
             "--json", str(agree_json), "--lm-head-quantization", head])
        out["agreement"] = json.loads(agree_json.read_text())
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="smollm2 (pulled on first use) or a float model folder")
    ap.add_argument("--schemes", default=",".join(DEFAULT_SCHEMES))
    ap.add_argument("--calib", default="licenses",
                    help="calibration text, or licenses: the non-GPL licenses concatenated (not GPL-3: the "
                         "evaluation text)")
    ap.add_argument("--group-size", type=int, default=64, help="W4A16 (SmolLM2's 576 is no multiple of 128)")
    ap.add_argument("--max-tokens", type=int, default=0, help="perplexity on the text's first N tokens (0 = all)")
    ap.add_argument("--num-prompts", type=int, default=8, help="agreement/KL prompts")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "quantize_accuracy.json"))
    args = ap.parse_args()
    model = model_folder(args.model)
    work = Path(tempfile.mkdtemp(prefix="pdmesh-quant-bench-"))
    if args.calib == "licenses":
        args.calib = str(work / "calibration.txt")
        Path(args.calib).write_text("\n\n".join((LICENSES / name).read_text() for name in CALIBRATION))
    report = {"command": " ".join(["python", "bench/quantize_accuracy.py", *sys.argv[1:]]),
              "machine": machine_info(), "model": str(model), "runs": [],
              "calibration": [str(LICENSES / n) for n in CALIBRATION] if args.calib == str(work / "calibration.txt")
              else args.calib}
    try:
        start = time.perf_counter()
        base = evaluate(model, None, args, work)
        report["float"] = {**base, "seconds": time.perf_counter() - start}
        base_ppl = base["perplexity"]["ppl"]
        for spec in args.schemes.split(","):
            scheme, fmt, *rest = spec.split(":")
            head = "int8" if "int8-head" in rest else "none"
            if scheme == "float":
                argv, quantized, folder = [], 0.0, model
            else:
                method = next((r for r in rest if r in ("rtn", "gptq")), "rtn")
                argv = ["quantize", str(model), "--scheme", scheme, "--format", fmt, "--calib", args.calib,
                        "--out", str(work / "q"), "--method", method, "--group-size", str(args.group_size)]
                if "nosmooth" in rest:
                    argv.append("--no-smooth")
                if "minmax" in rest:
                    argv += ["--static-range", "minmax"]
                start = time.perf_counter()
                run(argv)
                quantized, folder = time.perf_counter() - start, work / "q"
            result = evaluate(folder, model, args, work, head)
            ppl = result["perplexity"]["ppl"]
            report["runs"].append({"scheme": spec, "quantize_command": "pdmesh " + " ".join(argv) if argv else "",
                                   "quantize_seconds": quantized, **result, "ppl": ppl,
                                   "ppl_change": ppl / base_ppl - 1})
            print(f"{spec:48s} ppl {ppl:.4f} ({100 * (ppl / base_ppl - 1):+.2f}% vs float {base_ppl:.4f})")
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
