"""`pdmesh bench serve` end to end: make the requests, warm up, one run per rate, print,
write the JSON and the PNG.

    code = await run_serve_benchmark(ServeConfig(...), slos)   # 0: every request completed

The JSON: {"command", "target", "model", "dataset": {...}, "goodput_slos_ms",
"runs": [{"rate": R | "inf", **metrics.summarize(...)}]}; each run's requests are the
same list, so rates compare like with like.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from services.bench import datasets
from services.bench.metrics import summarize
from services.bench.plot import plot_rates
from services.bench.runner import one_request, run_at_rate


@dataclass(frozen=True)
class ServeConfig:
    gateway: str
    rates: tuple[float, ...]
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
    model: str = ""
    max_concurrency: int = 0
    warmup: int = 2
    seed: int = 0
    out: str = "bench-serve.json"
    plot: str = ""
    api_key_file: str = ""
    tls_dir: str = ""

    @classmethod
    def from_args(cls, args) -> "ServeConfig":
        from services.security.client_creds import mesh_address
        gateway = args.gateway or mesh_address("gateway") or "127.0.0.1:50050"
        names = {f for f in cls.__dataclass_fields__} - {"gateway", "rates"}
        return cls(gateway=gateway, rates=tuple(args.request_rate),
                   **{name: getattr(args, name) for name in names})

    def __post_init__(self) -> None:
        if self.num_prompts < 1:
            raise ValueError(f"--num-prompts must be >= 1, got {self.num_prompts}")
        if self.dataset == "jsonl" and not self.dataset_path:
            raise ValueError("--dataset jsonl needs --dataset-path")


def make_requests(cfg: ServeConfig, vocab_size: int, max_model_len: int) -> list[datasets.BenchRequest]:
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
            f"ITL p50 {s['itl']['median_ms']:.1f} ms; E2E p50 {s['e2e']['median_ms']:.0f} ms{good}")


async def run_serve_benchmark(cfg: ServeConfig, slos: dict[str, float] | None = None, argv=None) -> int:
    from protos.pdmesh.v1 import gateway_pb2, gateway_pb2_grpc
    from services.security.client_auth import client_channel
    from services.security.client_creds import api_key, client_tls
    channel = client_channel(cfg.gateway, bearer=api_key(cfg.api_key_file, address=cfg.gateway),
                             tls=client_tls(cfg.tls_dir, address=cfg.gateway))
    async with channel:
        models = await gateway_pb2_grpc.GatewayStub(channel).ListModels(gateway_pb2.ListModelsRequest(), timeout=30)
        info = models.models[0]
        requests = make_requests(cfg, info.vocab_size, info.max_model_len)
        stub = gateway_pb2_grpc.GatewayStub(channel)
        for req in requests[:cfg.warmup]:
            await one_request(stub, req, cfg.model)
        runs = []
        for rate in cfg.rates:
            results, duration = await run_at_rate(channel, requests, rate, cfg.seed, cfg.model, cfg.max_concurrency)
            summary = summarize(results, duration, slos)
            runs.append({"rate": "inf" if math.isinf(rate) else rate, **summary})
            print(_line(rate, summary), flush=True)
    report = {"command": " ".join(argv or []), "target": cfg.gateway, "model": info.id,
              "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "config": asdict(cfg) | {"rates": list(map(str, cfg.rates))},
              "dataset": {"name": cfg.dataset, "num_requests": len(requests),
                          "prompt_tokens": [r.num_prompt_tokens for r in requests],
                          "output_tokens": [r.max_tokens for r in requests]},
              "goodput_slos_ms": slos or {}, "runs": runs}
    out = Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    png = plot_rates(runs, cfg.plot or out.with_suffix(".png"), title=f"{info.id} at {cfg.gateway} ({cfg.dataset})")
    print(f"wrote {out} and {png}", flush=True)
    return 0 if all(r["failed"] == 0 for r in runs) else 1
