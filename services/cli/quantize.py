"""`pdmesh quantize`: a float model folder -> a quantized one the engine serves.

    pdmesh quantize MODEL --scheme w8a8|w8a8-dynamic|w8a8-mix|w4a16|c8|w8a8-mix+c8|... \
        --format modelslim|compressed-tensors --calib FILE --out DIR
        [--smooth-alpha auto|0.5 | --no-smooth] [--static-range search|minmax]
        [--method rtn|gptq] [--group-size 128]
        [--num-prompts 32] [--prompt-len 256]

--calib: a text file (cut into prompts of --prompt-len tokens) or a JSONL file (one
prompt a line: {"text"}, {"prompt"} or {"messages"} in the model's chat template), or
gpl-3 (the GPL-3 text every Debian has). W8A8 static needs the calibration for its
activation ranges, every scheme for smoothing and GPTQ. Formats: modelslim writes
msModelSlim's layout (quant_model_description.json; w8a8, w8a8-dynamic, w8a8-mix),
compressed-tensors llm-compressor's (w8a8-dynamic, w4a16). c8: an int8 KV cache with
per-channel scales (msModelSlim's C8) from the calibration's key (after rotary) and value
ranges: alone (float weights) or added to a W8A8 scheme ("w8a8-mix+c8", msModelSlim's
W8A8C8). MoE models: w8a8-dynamic quantizes the routed experts too (no calibration through
them); other schemes keep them float. MLA's kv_b_proj and the routers stay float in every
scheme (services/quantize/kept_float.py). Exit code 0, 2 on bad input.
"""
from __future__ import annotations

import argparse
import logging
import sys

from services.cli.eval import BUILTIN_TEXTS


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("quantize", help="write a quantized copy of a float model",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="float Hugging Face model folder")
    p.add_argument("--scheme", required=True, help="w8a8, w8a8-dynamic, w8a8-mix, w4a16, c8, or a w8a8 scheme +c8")
    p.add_argument("--format", required=True, dest="fmt", help="modelslim or compressed-tensors")
    p.add_argument("--calib", required=True, help="calibration text or JSONL file, or gpl-3")
    p.add_argument("--out", required=True, help="folder to write (replaced when it exists)")
    p.add_argument("--smooth-alpha", default="auto",
                   help="W8A8: SmoothQuant strength in [0, 1], or auto: per layer, the strength with the least "
                        "W8A8 output error on the calibration sample (default: %(default)s)")
    p.add_argument("--no-smooth", action="store_true", help="W8A8: plain round-to-nearest, no smoothing")
    p.add_argument("--static-range", default="search",
                   help="W8A8 static: each input's range, minmax (the calibration's) or search (the clip of it with "
                        "the least quantized output error on the calibration sample) (default: %(default)s)")
    p.add_argument("--method", default="rtn", help="W4A16: rtn or gptq (default: %(default)s)")
    p.add_argument("--group-size", type=int, default=128, help="W4A16: inputs a scale (default: %(default)s)")
    p.add_argument("--num-prompts", type=int, default=32, help="calibration prompts (default: %(default)s)")
    p.add_argument("--prompt-len", type=int, default=256, help="tokens a prompt at most (default: %(default)s)")
    return p


def run(args: argparse.Namespace) -> int:
    from services.quantize.calibration import calibration_prompts
    from services.quantize.quantizer import QuantizeOptions, quantize_model
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        alpha = args.smooth_alpha if args.smooth_alpha == "auto" else _number("--smooth-alpha", args.smooth_alpha)
        options = QuantizeOptions(args.scheme, args.fmt, None if args.no_smooth else alpha,
                                  args.method, args.group_size, args.static_range)
        if args.num_prompts < 1 or args.prompt_len < 2:
            raise ValueError("--num-prompts must be >= 1 and --prompt-len >= 2")
        prompts = calibration_prompts(args.model, BUILTIN_TEXTS.get(args.calib, args.calib), args.num_prompts,
                                      args.prompt_len)
        out = quantize_model(args.model, args.out, prompts, options)
    except (ValueError, FileNotFoundError) as e:
        print(f"pdmesh quantize: error: {e}", file=sys.stderr)
        return 2
    print(f"pdmesh quantize: {args.scheme} ({args.fmt}) written to {out}")
    return 0


def _number(flag: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{flag} must be 'auto' or a number in [0, 1], got {text!r}") from None
