"""`pdmesh generate`: run prompts and print the text and throughput.

Offline (default): through the engine in this process; with no model folder, the built-in
tiny model is made first (models/tiny-llama).
--gateway HOST:PORT: through a running mesh's gateway, one prompt after the other, the
text streamed to the terminal as it arrives, then TTFT and tokens/s.
The API key comes from --api-key-file, $PDMESH_API_KEY(_FILE) or the credentials of the
mesh `pdmesh up` is running; with TLS (--tls-dir, $PDMESH_TLS_DIR or the running mesh's)
the server is checked against that folder's CA.
With no prompt, a few built-in ones. Exit code 0, 1 on an RPC error, 2 on bad input.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

DEFAULT_MODEL = "models/tiny-llama"
DEMO_PROMPTS = [
    "The quick brown fox",
    "In a distant kingdom, the old queen said",
    "def fibonacci(n):",
    "Les fleurs du jardin",
]


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("generate", help="generate text offline or through a gateway",
                              description=__doc__)
    p.add_argument("prompts", nargs="*", help="prompts (default: a few built-in ones)")
    p.add_argument("--gateway", default="", metavar="HOST:PORT",
                   help="send the prompts to this gateway instead of running the engine here")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="offline: HF model folder or .gguf file (default: %(default)s); ignored with --gateway")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--api-key-file", default="", help="--gateway: file whose first line is the API key")
    p.add_argument("--tls-dir", default="", help="--gateway: folder of `pdmesh certs init` (TLS on)")
    return p


def sampling_kwargs(args: argparse.Namespace) -> dict:
    return dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                top_k=args.top_k, seed=args.seed, stop=list(args.stop), ignore_eos=args.ignore_eos)


def run(args: argparse.Namespace) -> int:
    if args.gateway:
        return _run_gateway(args)
    return _run_offline(args)


def _run_gateway(args: argparse.Namespace) -> int:
    import asyncio

    import grpc

    from services.security.credentials import MissingCredentialsError
    try:
        return asyncio.run(_stream_all(args))
    except MissingCredentialsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except grpc.aio.AioRpcError as e:
        print(f"\nerror: {args.gateway}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 2 if e.code() == grpc.StatusCode.INVALID_ARGUMENT else 1


async def _stream_all(args: argparse.Namespace) -> int:
    from services.cli.client import describe, stream_generate
    from services.security.client_auth import client_channel
    from services.security.client_creds import api_key, client_tls
    prompts = args.prompts or DEMO_PROMPTS
    num_tokens, start = 0, time.perf_counter()
    key = api_key(args.api_key_file, address=args.gateway)
    tls = client_tls(args.tls_dir, address=args.gateway)
    async with client_channel(args.gateway, bearer=key, tls=tls) as channel:
        for prompt in prompts:
            print(f"--- {prompt!r}\n{prompt}", end="", flush=True)
            result = await stream_generate(channel, prompt, **sampling_kwargs(args),
                                           on_text=lambda s: print(s, end="", flush=True))
            num_tokens += len(result.token_ids)
            print(f"\n--- {describe(result)}")
    elapsed = time.perf_counter() - start
    print(f"--- {len(prompts)} prompts, {num_tokens} tokens in {elapsed:.2f}s: "
          f"{num_tokens / elapsed:.1f} tokens/s")
    return 0


def _run_offline(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    model = Path(args.model)
    if not (model / "config.json").exists() and not (model.suffix == ".gguf" and model.is_file()):
        if args.model != DEFAULT_MODEL:
            print(f"error: --model {model}: no config.json there")
            return 2
        from common.model.tiny import make_tiny_model
        print(f"making the built-in tiny model in {model}", flush=True)
        make_tiny_model("llama", model)
    from common.engine import LLM, SamplingParams
    llm = LLM(str(model), device=args.device)
    params = SamplingParams(**sampling_kwargs(args))
    prompts = args.prompts or DEMO_PROMPTS
    try:
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
    except ValueError as e:
        print(f"error: {e}")
        return 2
    num_out = 0
    for prompt, out in zip(prompts, outs):
        c = out.outputs[0]
        num_out += len(c.token_ids)
        print(f"--- {prompt!r} ({len(out.prompt_token_ids)} prompt tokens, "
              f"{len(c.token_ids)} generated, finish_reason={c.finish_reason})")
        print(prompt + c.text)
    print(f"--- {len(prompts)} prompts, {num_out} tokens in {elapsed:.2f}s: "
          f"{num_out / elapsed:.1f} tokens/s")
    return 0
