"""What each quantization scheme does to a CPU decode step and to the weights' memory, on
SmolLM2-135M-Instruct: float32, bfloat16, and the checkpoints `pdmesh quantize` writes
(W8A8 dynamic, W8A8 static, W4A16, C8; the W8A8 ones also with `engine.lm_head_quantization:
int8`), all on the cpu backend in one process, the decode
step timed round by round in turn (so drift hits every scheme alike), ratios against
float32 per round and their median.

    python bench/quantize_speed.py [--model smollm2] [--batches 1,8] [--steps 48] [--rounds 3]
        [--schemes float32,w8a8-dynamic+int8-head,...] [--out bench/results/quantize_speed.json]

Decode step: the median of `steps` engine steps of `batch` requests decoding together
(16-token prompts, greedy). Weights: the bytes of every parameter as loaded (int8 codes,
scales, the embedding (int8 with an int8 head on a tied model) and norms), before the
backend packs the linears, and the linear layers' share alone; the KV bytes per token
beside them.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_model import ROOT, model_folder

from common.engine import LLM, SamplingParams  # noqa: E402
from services.bench.machine import machine_info  # noqa: E402
from services.cli import main as pdmesh  # noqa: E402

CALIBRATION = ("Apache-2.0", "MPL-2.0", "Artistic", "CC0-1.0", "BSD")
SCHEMES = {   # name -> (pdmesh quantize --scheme, --format) or None for the float model
    "float32": None, "bfloat16": None,
    "w8a8-dynamic": ("w8a8-dynamic", "compressed-tensors"), "w8a8-static": ("w8a8", "modelslim"),
    "w4a16": ("w4a16", "compressed-tensors"), "c8": ("c8", "modelslim"),
}
INT8_HEAD = "+int8-head"    # a scheme's checkpoint served with engine.lm_head_quantization int8
DEFAULT_SCHEMES = (*SCHEMES, "w8a8-dynamic" + INT8_HEAD, "w8a8-static" + INT8_HEAD)


def decode_step(llm: LLM, batch: int, steps: int, vocab: int) -> float:
    engine = llm.engine
    rng = random.Random(batch)
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}-{time.monotonic_ns()}", [rng.randrange(3, vocab) for _ in range(16)], params)
    engine.step()      # the prefills
    times = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def weight_bytes(llm: LLM) -> int:
    return sum(llm.engine.model.dense_bytes.values())


def linear_bytes(llm: LLM) -> int:
    """The linear layers' share (codes and scales; not the embedding, LM head or norms)."""
    model = llm.engine.model
    prefixes = tuple(name + "." for name, _ in model.linears())
    return sum(size for name, size in model.dense_bytes.items() if name.startswith(prefixes))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--schemes", default=",".join(DEFAULT_SCHEMES),
                    help=f"of {', '.join(SCHEMES)}, each optionally with {INT8_HEAD} (float32 always runs)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "quantize_speed.json"))
    args = ap.parse_args()
    model = model_folder(args.model)
    work = Path(tempfile.mkdtemp(prefix="pdmesh-quant-speed-"))
    calib = work / "calibration.txt"
    calib.write_text("\n\n".join(Path("/usr/share/common-licenses", n).read_text() for n in CALIBRATION))
    names = ["float32", *(n for n in args.schemes.split(",") if n and n != "float32")]
    for name in names:
        if name.removesuffix(INT8_HEAD) not in SCHEMES:
            raise SystemExit(f"--schemes: unknown {name!r}; allowed: {', '.join(SCHEMES)}, each with {INT8_HEAD}")
    folders: dict[str, Path] = {}
    for base in dict.fromkeys(n.removesuffix(INT8_HEAD) for n in names):
        spec = SCHEMES[base]
        if spec is None:
            folders[base] = model
            continue
        out = work / base
        code = pdmesh(["quantize", str(model), "--scheme", spec[0], "--format", spec[1], "--calib", str(calib),
                       "--group-size", str(args.group_size), "--out", str(out)])
        if code != 0:
            raise SystemExit(f"pdmesh quantize {base} exited {code}")
        folders[base] = out
    engines = {name: LLM(str(folders[name.removesuffix(INT8_HEAD)]), kernel_backend="cpu", num_blocks=256,
                         dtype="bfloat16" if name.startswith("bfloat16") else "float32",
                         lm_head_quantization="int8" if name.endswith(INT8_HEAD) else "none")
               for name in names}
    vocab = engines["float32"].engine.vocab_size
    batches = [int(b) for b in args.batches.split(",")]
    report = {"command": " ".join(["python", "bench/quantize_speed.py", *sys.argv[1:]]), "machine": machine_info(),
              "model": str(model), "steps": args.steps, "rounds": args.rounds, "schemes": {}}
    timings: dict[str, dict[int, list[float]]] = {name: {b: [] for b in batches} for name in engines}
    for llm in engines.values():    # warm-up: first-call costs (allocations, oneDNN's kernel choice) out of the rounds
        for b in batches:
            decode_step(llm, b, 4, vocab)
    for r in range(args.rounds):
        for b in batches:
            for name, llm in engines.items():
                timings[name][b].append(decode_step(llm, b, args.steps, vocab))
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    for name, llm in engines.items():
        kv = llm.engine.kv_cache
        entry = {"weight_bytes": weight_bytes(llm),
                 "weight_ratio": weight_bytes(llm) / weight_bytes(engines["float32"]),
                 "linear_bytes": linear_bytes(llm),
                 "linear_ratio": linear_bytes(llm) / linear_bytes(engines["float32"]),
                 "kv_bytes_per_token": kv[:, :, 0, 0].numel() * kv.element_size(),
                 "decode_step_ms": {}, "ratio_to_float32": {}}
        for b in batches:
            ratios = [t / f for t, f in zip(timings[name][b], timings["float32"][b])]
            entry["decode_step_ms"][b] = [t * 1e3 for t in timings[name][b]]
            entry["ratio_to_float32"][b] = statistics.median(ratios)
        report["schemes"][name] = entry
        steps = ", ".join(f"batch {b}: {statistics.median(entry['decode_step_ms'][b]):.1f} ms "
                          f"({entry['ratio_to_float32'][b]:.2f}x)" for b in batches)
        print(f"{name:24s} weights {entry['weight_bytes'] / 2**20:7.1f} MiB ({entry['weight_ratio']:.2f}x; "
              f"linears {entry['linear_ratio']:.2f}x), "
              f"KV {entry['kv_bytes_per_token']} B/token; decode step {steps}")
    for llm in engines.values():
        llm.close()
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
