"""`pdmesh eval`: accuracy you can measure.

Perplexity of a text (sliding windows, Hugging Face's recipe: every token but the first
scored exactly once, with as much left context as the window allows):
    pdmesh eval --model M --text FILE [--window 512] [--stride 256] [--max-tokens N] [--json OUT]
    pdmesh eval --gateway HOST:PORT --text FILE ...      (through a running mesh)
The text is tokenized by the model's tokenizer with add_special_tokens (only what its
post-processor adds by itself, e.g. a BOS; the JSON lists them as special_ids).

Agreement and KL of M against a reference R, teacher-forced on a prompt set (the text
cut into --num-prompts windows of --prompt-len tokens; "gpl-3" is the GPL-3 text every
Debian/Ubuntu has), both in this process with full distributions:
    pdmesh eval --model M --reference R [--prompts FILE|gpl-3] [--json OUT]

One summary line is printed; --json writes every number with the text's sha256, model,
tokenizer, dtype and seconds. Exit code 0, 1 on an RPC error, 2 on bad input.
The API key and TLS of --gateway are found as `pdmesh generate` finds them.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

BUILTIN_TEXTS = {"gpl-3": "/usr/share/common-licenses/GPL-3"}


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("eval", help="perplexity of a text, agreement/KL against a reference model",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="HF model folder or .gguf file, run in this process")
    p.add_argument("--gateway", default="", metavar="HOST:PORT", help="perplexity through this gateway instead")
    p.add_argument("--text", default="", help="perplexity: the text file (or gpl-3)")
    p.add_argument("--window", type=int, default=512, help="perplexity: tokens a window (default: %(default)s)")
    p.add_argument("--stride", type=int, default=256, help="perplexity: tokens between windows (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=0, help="perplexity: only the text's first N tokens (0 = all)")
    p.add_argument("--reference", default="", help="agreement/KL: the reference model folder")
    p.add_argument("--prompts", default="gpl-3", help="agreement/KL: text file cut into prompts, or gpl-3 (default)")
    p.add_argument("--num-prompts", type=int, default=8, help="agreement/KL: prompts (default: %(default)s)")
    p.add_argument("--prompt-len", type=int, default=256, help="agreement/KL: tokens a prompt (default: %(default)s)")
    p.add_argument("--json", default="", metavar="OUT", help="write the result as JSON to OUT")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto", help="in-process engines' dtype (default: auto = float32 on CPU)")
    p.add_argument("--lm-head-quantization", default="none", choices=("none", "int8"),
                   help="--model's engine: its LM head (and tied embedding) in int8 (default: %(default)s)")
    p.add_argument("--api-key-file", default="", help="--gateway: file whose first line is the API key")
    p.add_argument("--tls-dir", default="", help="--gateway: folder of `pdmesh certs init` (TLS on)")
    return p


def read_text(name: str) -> tuple[str, str, str]:
    """(path, text, sha256 of its bytes) of a file or a built-in name; OSError if unreadable."""
    path = BUILTIN_TEXTS.get(name, name)
    data = Path(path).read_bytes()
    return path, data.decode("utf-8"), hashlib.sha256(data).hexdigest()


def run(args: argparse.Namespace) -> int:
    if bool(args.model) == bool(args.gateway):
        print("pdmesh eval: error: give exactly one of --model or --gateway", file=sys.stderr)
        return 2
    try:
        if args.reference:
            if args.gateway:
                raise ValueError("--reference runs in this process: it needs --model, not --gateway")
            result = _agreement(args)
        else:
            if not args.text:
                raise ValueError("--text FILE is needed for perplexity (or --reference for agreement/KL)")
            result = _perplexity(args)
    except (ValueError, OSError) as e:
        print(f"pdmesh eval: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:   # an RPC error from --gateway
        import grpc
        if not isinstance(e, grpc.RpcError):
            raise
        print(f"pdmesh eval: error: {args.gateway}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 2 if e.code() == grpc.StatusCode.INVALID_ARGUMENT else 1
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(result["summary"], flush=True)
    return 0


def _scorer(args: argparse.Namespace):
    from services.eval.scorers import EngineScorer, GatewayScorer
    if args.gateway:
        from services.security.client_creds import api_key, client_tls
        return GatewayScorer(args.gateway, api_key(args.api_key_file, address=args.gateway),
                             client_tls(args.tls_dir, address=args.gateway))
    from common.engine import LLM
    return EngineScorer(LLM(args.model, device=args.device, dtype=args.dtype,
                            lm_head_quantization=args.lm_head_quantization))


def _perplexity(args: argparse.Namespace) -> dict:
    from services.eval.perplexity import perplexity
    if args.max_tokens < 0:
        raise ValueError(f"--max-tokens must be >= 0 (0 = all), got {args.max_tokens}")
    path, text, sha = read_text(args.text)
    start = time.perf_counter()
    scorer = _scorer(args)
    encoded = scorer.encode(text)
    ids = encoded.token_ids[:args.max_tokens] if args.max_tokens else encoded.token_ids
    result = perplexity(ids, args.window, args.stride, scorer)
    seconds = time.perf_counter() - start
    summary = (f"perplexity {result.ppl:.4f} (nll {result.nll:.5f} nats/token over {result.scored} tokens, "
               f"{result.num_windows} windows of {result.window} every {result.stride}; {scorer.model}, "
               f"{scorer.dtype}; {seconds:.1f} s)")
    return {"mode": "perplexity", "ppl": result.ppl, "nll": result.nll, "scored": result.scored,
            "num_windows": result.num_windows, "window": result.window, "stride": result.stride,
            "num_tokens": len(ids), "text": path, "text_sha256": sha, "model": scorer.model,
            "model_id": scorer.model_id, "tokenizer": scorer.tokenizer, "add_special_tokens": True,
            "special_ids": encoded.special_ids, "dtype": scorer.dtype, "seconds": seconds, "summary": summary}


def _agreement(args: argparse.Namespace) -> dict:
    from common.engine import LLM
    from services.eval.agreement import agreement
    from services.eval.scorers import EngineScorer
    from services.eval.windows import prompt_windows
    path, text, sha = read_text(args.prompts)
    start = time.perf_counter()
    model = LLM(args.model, device=args.device, dtype=args.dtype, lm_head_quantization=args.lm_head_quantization)
    same = (Path(args.reference).resolve() == Path(args.model).resolve()) and args.lm_head_quantization == "none"
    reference = model if same else LLM(args.reference, device=args.device, dtype=args.dtype)
    encoded = EngineScorer(model).encode(text)
    spans = prompt_windows(len(encoded.token_ids), args.num_prompts, args.prompt_len)
    if args.prompt_len + 1 > min(model.engine.max_model_len, reference.engine.max_model_len):
        raise ValueError(f"--prompt-len must be below both models' max_model_len, got {args.prompt_len}")
    result = agreement(model, reference, [encoded.token_ids[a:b] for a, b in spans])
    seconds = time.perf_counter() - start
    dtype = str(model.engine.dtype).removeprefix("torch.")
    summary = (f"agreement {result.agreement:.4f}, KL(reference || model) {result.kl:.6f} nats over "
               f"{result.positions} positions ({result.num_prompts} prompts of {args.prompt_len}); "
               f"{args.model} vs {args.reference}, {dtype}; {seconds:.1f} s")
    return {"mode": "agreement", "agreement": result.agreement, "kl": result.kl, "positions": result.positions,
            "num_prompts": result.num_prompts, "prompt_len": args.prompt_len, "prompts": path,
            "text_sha256": sha, "model": args.model, "reference": args.reference,
            "tokenizer": f"{args.model}/tokenizer.json", "add_special_tokens": True,
            "special_ids": encoded.special_ids, "dtype": dtype, "seconds": seconds, "summary": summary}
