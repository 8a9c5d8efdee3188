"""`pdmesh bench serve`: the online benchmark users run against a gateway, or against
any OpenAI-compatible server (vLLM, SGLang, ...) with the same requests and timing.
`pdmesh bench profile`: one node's measured rates, the profile the planner sizes pools
with (services/cli/bench_profile.py; docs/planner.md).

    pdmesh bench serve --gateway HOST:PORT --dataset random --num-prompts 48 \\
        --request-rate 0.5,1,2,inf --goodput ttft:2000 tpot:100 --out serving.json
    pdmesh bench serve --backend openai --base-url http://127.0.0.1:8000 --vocab-size 640 ...

For each rate (requests/s, Poisson arrivals seeded by --seed; inf = all at once) the same
requests are sent, after --warmup requests that are not counted; the summary (TTFT, TPOT,
ITL, E2E mean / p50 / p90 / p99 in ms, output tokens/s, requests/s, goodput) is printed
per rate and written to --out as JSON, with a PNG of the percentiles against the rate
(--plot, default next to --out). Datasets:

    random         log-normal lengths around --random-input-len / --random-output-len
                   (--random-sigma; 0 = fixed), random token ids
    shared-prefix  --sp-num-groups system prompts of --sp-system-len tokens, each with
                   --sp-prompts-per-group questions of --sp-question-len tokens
    jsonl          --dataset-path: one {"prompt": ...} or {"prompt_token_ids": [...]} a line,
                   optional "max_tokens" (default --random-output-len)

Backends: grpc (default; a pdmesh gateway's Generate stream, credentials as for
`pdmesh generate`) and openai (streamed POST /v1/completions, prompts as token ids,
return_token_ids for each chunk's ids as vLLM has it; --api-key-file or $OPENAI_API_KEY;
the random and shared-prefix datasets need --vocab-size, which the OpenAI API does not
tell). Every request is greedy with ignore_eos (a JSONL line may say "ignore_eos": false),
so it makes exactly its max_tokens tokens. --save-detailed adds each request's timings and
output token ids to the JSON. Exit code 0 when every request completed, 1 when some
failed or the server could not be reached, 2 on bad arguments.
"""
from __future__ import annotations

import argparse
import sys


def _rates(text: str) -> list[float]:
    rates = []
    for item in text.split(","):
        item = item.strip()
        try:
            rate = float(item)
        except ValueError:
            raise argparse.ArgumentTypeError(f"a rate is a number of requests/s or inf, got {item!r}") from None
        if not rate > 0:
            raise argparse.ArgumentTypeError(f"a rate must be > 0 (or inf), got {item!r}")
        rates.append(rate)
    return rates


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench", help="benchmark a running mesh", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    s = actions.add_parser("serve", help="online serving benchmark against a gateway", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("--backend", choices=("grpc", "openai"), default="grpc",
                   help="grpc: a pdmesh gateway; openai: an OpenAI-compatible HTTP server (default: grpc)")
    s.add_argument("--gateway", default="", metavar="HOST:PORT",
                   help="grpc: the gateway (default: the running mesh's, else 127.0.0.1:50050)")
    s.add_argument("--base-url", default="", metavar="URL", help="openai: the server, e.g. http://127.0.0.1:8000")
    s.add_argument("--api-key-file", default="")
    s.add_argument("--tls-dir", default="", help="grpc only")
    s.add_argument("--model", default="", help="the model to ask for (default: the server's first)")
    s.add_argument("--dataset", choices=("random", "shared-prefix", "jsonl"), default="random")
    s.add_argument("--dataset-path", default="", help="jsonl: the file")
    s.add_argument("--num-prompts", type=int, default=48)
    s.add_argument("--random-input-len", type=int, default=190)
    s.add_argument("--random-output-len", type=int, default=65)
    s.add_argument("--random-sigma", type=float, default=0.5)
    s.add_argument("--sp-num-groups", type=int, default=4)
    s.add_argument("--sp-prompts-per-group", type=int, default=8)
    s.add_argument("--sp-system-len", type=int, default=512)
    s.add_argument("--sp-question-len", type=int, default=64)
    s.add_argument("--sp-output-len", type=int, default=64)
    s.add_argument("--vocab-size", type=int, default=0,
                   help="random token ids below this (default: the server's; openai backends need it)")
    s.add_argument("--request-rate", type=_rates, default=[float("inf")], metavar="R1,R2,...",
                   help="requests/s per run, comma-separated; inf = all at once (default: inf)")
    s.add_argument("--max-concurrency", type=int, default=0, help="most requests in flight (0 = no bound)")
    s.add_argument("--goodput", nargs="*", default=[], metavar="NAME:MS", help="SLOs: ttft:MS tpot:MS e2e:MS")
    s.add_argument("--warmup", type=int, default=2, help="requests sent first, not counted")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--out", default="bench-serve.json", help="the JSON (default: %(default)s)")
    s.add_argument("--plot", default="", help="the PNG (default: --out with .png; none = no PNG)")
    s.add_argument("--save-detailed", action="store_true",
                   help="per request timings and output token ids in the JSON")
    from services.cli.bench_profile import add_profile_parser
    add_profile_parser(actions)
    return p


def run(args: argparse.Namespace) -> int:
    if args.action == "profile":
        from services.cli.bench_profile import run_profile
        return run_profile(args)
    import asyncio

    import grpc

    from services.bench.base import ServerUnreachable
    from services.bench.metrics import parse_goodput
    from services.bench.serve import ServeConfig, run_serve_benchmark
    from services.security.credentials import MissingCredentialsError
    try:
        slos = parse_goodput(args.goodput)
        config = ServeConfig.from_args(args)
        code = asyncio.run(run_serve_benchmark(config, slos, argv=sys.argv))
    except (ValueError, MissingCredentialsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except grpc.aio.AioRpcError as e:   # the gateway itself (ListModels): unreachable, refused
        print(f"error: {args.gateway or 'the gateway'}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    except ServerUnreachable as e:     # the openai server itself (GET /v1/models)
        print(f"error: {e}", file=sys.stderr)
        return 1
    return code
