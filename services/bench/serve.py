"""`pdmesh bench serve` end to end: make the requests, warm up, one run per rate, print,
write the JSON and the PNG.

    code = await run_serve_benchmark(ServeConfig(...), slos)   # 0: every request completed

The backend (services/bench/base.py) is "grpc" (a pdmesh gateway, cfg.gateway) or
"openai" (an OpenAI-compatible server, cfg.base_url); the requests and the timing are the
same, so the JSONs of two servers compare like with like.

The JSON: {"command", "machine", "backend", "target", "model", "time", "config",
"dataset": {...}, "goodput_slos_ms", "runs": [{"rate": R | "inf", **metrics.summarize(...)}]};
with save_detailed each run also holds "requests": per request (in dataset order) its
ttft_ms, e2e_ms, itl_ms, output_tokens, output_token_ids and error. Each run's requests
are the same list, so rates compare like with like.
"""
from __future__ import annotations

import json
import math
import shlex
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from services.bench import datasets
from services.bench.base import Backend, ModelInfo, create_backend
from services.bench.machine import machine_info
from services.bench.metrics import RequestResult, summarize
from services.bench.plot import plot_rates
from services.bench.runner import run_at_rate


@dataclass(frozen=True)
class ServeConfig:
    gateway: str
    rates: tuple[float, ...]
    backend: str = "grpc"
    base_url: str = ""                 # openai: http://HOST:PORT
    dataset: str = "random"
    num_prompts: int = 48
    random_input_len: int = 190
    random_output_len: int = 65
    random_sigma: float = 0.5
    sp_num_groups: int = 4
    sp_prompts_per_group: int = 8
    sp_system_len: int = 512
    sp_question_len: int = 64
    sp_output_len: int = 64
    dataset_path: str = ""
    vocab_size: int = 0                # 0: the server's (the OpenAI API does not tell it)
    model: str = ""
    max_concurrency: int = 0
    warmup: int = 2
    seed: int = 0
    out: str = "bench-serve.json"
    plot: str = ""
    save_detailed: bool = False
    api_key_file: str = ""
    tls_dir: str = ""

    @classmethod
    def from_args(cls, args) -> "ServeConfig":
        gateway = args.gateway
        if args.backend == "grpc" and not gateway:
            from services.security.client_creds import mesh_address
            gateway = mesh_address("gateway") or "127.0.0.1:50050"
        names = {f for f in cls.__dataclass_fields__} - {"gateway", "rates"}
        return cls(gateway=gateway, rates=tuple(args.request_rate),
                   **{name: getattr(args, name) for name in names})

    def __post_init__(self) -> None:
        if self.num_prompts < 1:
            raise ValueError(f"--num-prompts must be >= 1, got {self.num_prompts}")
        if self.dataset == "jsonl" and not self.dataset_path:
            raise ValueError("--dataset jsonl needs --dataset-path")
        if self.backend == "openai" and not self.base_url:
            raise ValueError("--backend openai needs --base-url http://HOST:PORT")
        if self.backend == "openai" and self.tls_dir:
            raise ValueError("--tls-dir is for the grpc backend; give the openai backend an https:// --base-url")

    @property
    def target(self) -> str:
        return self.base_url if self.backend == "openai" else self.gateway

    def make_backend(self) -> Backend:
        if self.backend == "grpc":
            return create_backend("grpc", address=self.gateway, model=self.model, api_key_file=self.api_key_file,
                                  tls_dir=self.tls_dir)
        return create_backend(self.backend, base_url=self.base_url, model=self.model,
                              api_key_file=self.api_key_file)


def make_requests(cfg: ServeConfig, vocab_size: int, max_model_len: int) -> list[datasets.BenchRequest]:
    if cfg.dataset in ("random", "shared-prefix") and not (cfg.vocab_size or vocab_size):
        raise ValueError(f"the {cfg.dataset} dataset draws token ids below the vocabulary size, which "
                         f"{cfg.target} does not tell: give --vocab-size")
    vocab_size = cfg.vocab_size or vocab_size
    if cfg.dataset == "random":
        return datasets.random_requests(cfg.num_prompts, cfg.random_input_len, cfg.random_output_len, vocab_size,
                                        cfg.random_sigma, cfg.seed, max_model_len)
    if cfg.dataset == "shared-prefix":
        return datasets.shared_prefix_requests(cfg.sp_num_groups, cfg.sp_prompts_per_group, cfg.sp_system_len,
                                               cfg.sp_question_len, cfg.sp_output_len, vocab_size, cfg.seed)
    return datasets.jsonl_requests(cfg.dataset_path, cfg.random_output_len, cfg.num_prompts)


def _line(rate: float, s: dict) -> str:
    name = "inf" if math.isinf(rate) else f"{rate:g}"
    good = f", goodput {s['request_goodput']:.2f} req/s" if "request_goodput" in s else ""
    return (f"rate {name:>5}: {s['completed']}/{s['num_requests']} ok, {s['output_throughput']:.1f} tok/s, "
            f"{s['request_throughput']:.2f} req/s; TTFT p50/p99 {s['ttft']['median_ms']:.0f}/"
            f"{s['ttft']['p99_ms']:.0f} ms; TPOT p50/p99 {s['tpot']['median_ms']:.1f}/{s['tpot']['p99_ms']:.1f} ms; "
            f"ITL p50 {s['itl']['median_ms']:.1f} ms; E2E p50 {s['e2e']['median_ms']:.0f} ms{good}{_handoff(s)}")


def _handoff(s: dict) -> str:
    if "handoff" not in s:
        return ""
    h = s["handoff"]
    return (f"; hand-off (TTFT - remote queue+compute+transfer) p50/p99 {h['median_ms']:.1f}/"
            f"{h['p99_ms']:.1f} ms over {h['requests']} remote prefills")


def detailed(results: list[RequestResult]) -> list[dict]:
    return [{"ttft_ms": r.ttft_s * 1e3, "e2e_ms": r.e2e_s * 1e3, "itl_ms": [g * 1e3 for g in r.itl_s],
             "output_tokens": r.num_output_tokens, "output_token_ids": r.output_token_ids, "error": r.error}
            for r in results]


def command_line(argv) -> str:
    """argv as a shell line; `python -m services.cli ...` and the pdmesh script both read
    as `pdmesh ...`."""
    argv = list(argv or [])
    if argv and Path(argv[0]).name in ("pdmesh", "__main__.py"):
        argv[0] = "pdmesh"
    return shlex.join(argv)


async def run_serve_benchmark(cfg: ServeConfig, slos: dict[str, float] | None = None, argv=None) -> int:
    async with cfg.make_backend() as backend:
        info: ModelInfo = await backend.model_info()
        requests = make_requests(cfg, info.vocab_size, info.max_model_len)
        for req in requests[:cfg.warmup]:
            await backend.one_request(req)
        runs = []
        for rate in cfg.rates:
            results, duration = await run_at_rate(backend, requests, rate, cfg.seed, cfg.max_concurrency)
            summary = summarize(results, duration, slos)
            runs.append({"rate": "inf" if math.isinf(rate) else rate, **summary})
            if cfg.save_detailed:
                runs[-1]["requests"] = detailed(results)
            print(_line(rate, summary), flush=True)
    report = {"command": command_line(argv), "machine": machine_info(), "backend": cfg.backend,
              "target": cfg.target, "model": info.id,
              "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "config": asdict(cfg) | {"rates": list(map(str, cfg.rates))},
              "dataset": {"name": cfg.dataset, "num_requests": len(requests),
                          "prompt_tokens": [r.num_prompt_tokens for r in requests],
                          "output_tokens": [r.max_tokens for r in requests]},
              "goodput_slos_ms": slos or {}, "runs": runs}
    out = Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    if cfg.plot != "none":
        png = plot_rates(runs, cfg.plot or out.with_suffix(".png"), title=f"{info.id} at {cfg.target} ({cfg.dataset})")
        print(f"wrote {out} and {png}", flush=True)
    else:
        print(f"wrote {out}", flush=True)
    return 0 if all(r["failed"] == 0 for r in runs) else 1
