"""One interval's load as the planner reads it (a LoadSample), from what the meta-server
already sees:

    requests, mean prompt and output tokens,   the gateways' reports of the requests that
    observed TTFT and ITL                      ended in the interval (load_window.py)
    prefix hit rate                            Route: of the prompt tokens routed in the
                                               interval, those the chosen prefilling node
                                               was predicted to hold (its PrefixIndex) or
                                               the kv-store held (cache_aware), router.py
    prefill queue tokens                       prompts waiting at prefill nodes at their last
                                               heartbeat (NodeLoad.waiting) x the mean
                                               prompt left after the hits (the reports' mean
                                               prompt, else the routes')
    decode KV use                              used / total KV blocks over the live decode
                                               and both nodes (heartbeats); shown and
                                               exported, not in the formula
    nodes per role                             live, undrained members: prefill nodes; decode
                                               and both nodes (a both node decodes and
                                               prefills its own prompts)

Pure: reads its arguments only.
"""
from __future__ import annotations

from dataclasses import dataclass

from services.meta_server.load_window import RequestTotals
from services.meta_server.planner import LoadSample


@dataclass(frozen=True)
class RoutedTokens:
    """Route's counts over the interval (differences of Router's running totals)."""

    num_routes: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0


@dataclass(frozen=True)
class PlannerInputs:
    sample: LoadSample
    interval_s: float
    decode_kv_usage: float

    @property
    def request_rate(self) -> float:
        return self.sample.requests / self.interval_s


def gather(totals: RequestTotals, routed: RoutedTokens, members, drained: frozenset[str],
           interval_s: float) -> PlannerInputs:
    """members: the live Members (registry.alive()); drained: the drained node ids."""
    hit_rate = min(routed.hit_tokens / routed.prompt_tokens, 1.0) if routed.prompt_tokens else 0.0
    mean_prompt = totals.mean_prompt_tokens or (routed.prompt_tokens / routed.num_routes if routed.num_routes else 0.0)
    prefills = [m for m in members if m.role == "prefill"]
    decodes = [m for m in members if m.role in ("decode", "both")]
    waiting = sum(m.info.load.waiting for m in prefills)
    used = sum(m.info.load.total_blocks - m.info.load.free_blocks for m in decodes)
    total = sum(m.info.load.total_blocks for m in decodes)
    sample = LoadSample(
        requests=totals.num_requests, mean_prompt_tokens=totals.mean_prompt_tokens,
        mean_output_tokens=totals.mean_output_tokens, prefix_hit_rate=hit_rate,
        prefill_queue_tokens=round(waiting * mean_prompt * (1 - hit_rate)),
        observed_ttft_s=totals.mean_ttft_s, observed_itl_s=totals.mean_itl_s,
        prefill_nodes=sum(m.node_id not in drained for m in prefills),
        decode_nodes=sum(m.node_id not in drained for m in decodes))
    return PlannerInputs(sample, interval_s, used / total if total else 0.0)
