"""The numbers of one benchmark run, as `vllm bench serve` defines them.

Per request (RequestResult): TTFT (send -> first token), ITL (the gaps between
consecutive streamed messages after the first), TPOT ((E2E - TTFT) / (output tokens - 1),
for requests with more than one token), E2E (send -> last message).

Where the server says how long a remote prefill took (pdmesh's gateway: PrefillTiming
on the first message), `handoff` is TTFT minus the prefill node's queue + compute +
transfer: what the mesh adds around the remote prefill (routing, RPC hops, the decode
node's hand-off).

Per run (summarize): mean, median (p50), p90 and p99 of each in milliseconds (numpy's
linear percentiles); output tokens/s and requests/s over the run's duration (first send
-> last completion); goodput, DistServe's definition: completed requests that meet every
given SLO (ttft, tpot, e2e in ms) per second of the run.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)
SLO_NAMES = ("ttft", "tpot", "e2e")


@dataclass
class RequestResult:
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    error: str = ""                 # "" = completed; else the status code name
    output_token_ids: list[int] = field(default_factory=list)   # as streamed (empty if the server sent none)
    remote_prefill_s: float | None = None   # queue + compute + transfer of a remote prefill, if reported

    @property
    def handoff_s(self) -> float | None:
        return None if self.remote_prefill_s is None else self.ttft_s - self.remote_prefill_s

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def tpot_s(self) -> float | None:
        if self.num_output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.num_output_tokens - 1)


def parse_goodput(items: list[str]) -> dict[str, float]:
    """["ttft:500", "tpot:100"] -> {"ttft": 500.0, "tpot": 100.0}; ValueError naming the
    allowed names."""
    slos = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_NAMES:
            raise ValueError(f"--goodput takes NAME:MS with NAME one of {', '.join(SLO_NAMES)}, got {item!r}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if slos[name] <= 0:
            raise ValueError(f"--goodput {item!r}: the SLO must be > 0 ms")
    return slos


def _stats(values_s: list[float]) -> dict[str, float]:
    if not values_s:
        return {"mean_ms": 0.0, "median_ms": 0.0, **{f"p{p}_ms": 0.0 for p in PERCENTILES if p != 50}}
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    out = {"mean_ms": float(ms.mean()), "median_ms": float(np.percentile(ms, 50))}
    out.update({f"p{p}_ms": float(np.percentile(ms, p)) for p in PERCENTILES if p != 50})
    return out


def meets(result: RequestResult, slos: dict[str, float]) -> bool:
    if not result.ok:
        return False
    measured = {"ttft": result.ttft_s, "tpot": result.tpot_s if result.tpot_s is not None else 0.0,
                "e2e": result.e2e_s}
    return all(measured[name] * 1000.0 <= slo for name, slo in slos.items())


def summarize(results: list[RequestResult], duration_s: float, slos: dict[str, float] | None = None) -> dict:
    done = [r for r in results if r.ok]
    duration_s = max(duration_s, 1e-9)
    out_tokens = sum(r.num_output_tokens for r in done)
    summary = {
        "num_requests": len(results), "completed": len(done), "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if not r.ok}),
        "duration_s": duration_s,
        "total_input_tokens": sum(r.num_prompt_tokens for r in done), "total_output_tokens": out_tokens,
        "request_throughput": len(done) / duration_s, "output_throughput": out_tokens / duration_s,
        "ttft": _stats([r.ttft_s for r in done]),
        "tpot": _stats([r.tpot_s for r in done if r.tpot_s is not None]),
        "itl": _stats([gap for r in done for gap in r.itl_s]),
        "e2e": _stats([r.e2e_s for r in done]),
    }
    handoffs = [r.handoff_s for r in done if r.handoff_s is not None]
    if handoffs:
        summary["handoff"] = {**_stats(handoffs), "requests": len(handoffs)}
    if slos:
        summary["goodput_slos_ms"] = dict(slos)
        summary["request_goodput"] = sum(meets(r, slos) for r in results) / duration_s
    return summary
