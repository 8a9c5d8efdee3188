"""`pdmesh admin planner`: MetaAdmin/GetPlanner as a dict (--json) and as text.

    planner: on, every 30s for TTFT <= 1000 ms, ITL <= 100 ms; 1..8 nodes a role; profile prof.json
    decision 4, 12.3s ago, over the last 30s:
      requests   300 (10.00/s), mean prompt 960 tokens, mean output 128 tokens
      caches     50.0% of prompt tokens hit; prefill queue 0 tokens; decode KV use 42.0%
      observed   TTFT 200.0 ms, ITL 40.0 ms
    ROLE     NOW  WANTED  DESIRED  WHY
    prefill  2    2       2        4800 prompt tokens/s (isl 480 after a 50% hit rate) at ...
    decode   4    4       4        1280 output tokens/s at 320 tokens/s a node for ...
"""
from __future__ import annotations

from services.cli.admin import table


def planner_dict(reply) -> dict:
    """A GetPlannerResponse as JSON-able data; observed latencies None when not seen."""
    if not reply.enabled:
        return {"enabled": False}
    out = {"enabled": True, "interval_s": reply.interval_s, "ttft_slo_ms": reply.ttft_slo_ms,
           "itl_slo_ms": reply.itl_slo_ms, "min_nodes": reply.min_nodes, "max_nodes": reply.max_nodes,
           "profile": reply.profile, "num_decisions": reply.num_decisions}
    if not reply.num_decisions:
        return out
    i = reply.inputs
    out["seconds_since_decision"] = round(reply.seconds_since_decision, 3)
    out["inputs"] = {
        "interval_s": i.interval_s, "num_requests": i.num_requests, "request_rate": i.request_rate,
        "mean_prompt_tokens": i.mean_prompt_tokens, "mean_output_tokens": i.mean_output_tokens,
        "prefix_hit_rate": i.prefix_hit_rate, "prefill_queue_tokens": i.prefill_queue_tokens,
        "decode_kv_usage": i.decode_kv_usage, "observed_ttft_s": i.observed_ttft_s or None,
        "observed_itl_s": i.observed_itl_s or None, "prefill_nodes": i.prefill_nodes,
        "decode_nodes": i.decode_nodes}
    out["roles"] = [{"role": r.role, "current_nodes": r.current_nodes, "wanted_nodes": r.wanted_nodes,
                     "desired_nodes": r.desired_nodes, "reason": r.reason} for r in reply.roles]
    return out


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"


def planner_text(p: dict) -> str:
    if not p["enabled"]:
        return "planner: off (meta_server.planner.enabled is false)"
    head = (f'planner: on, every {p["interval_s"]:g}s for TTFT <= {p["ttft_slo_ms"]:g} ms, ITL <= '
            f'{p["itl_slo_ms"]:g} ms; {p["min_nodes"]}..{p["max_nodes"]} nodes a role; profile {p["profile"]}')
    if not p["num_decisions"]:
        return head + f'\nno decision yet (the first comes {p["interval_s"]:g}s after the meta-server started)'
    i = p["inputs"]
    lines = [head,
             f'decision {p["num_decisions"]}, {p["seconds_since_decision"]:.1f}s ago, over the last '
             f'{i["interval_s"]:g}s:',
             f'  requests   {i["num_requests"]} ({i["request_rate"]:.2f}/s), mean prompt '
             f'{i["mean_prompt_tokens"]:.0f} tokens, mean output {i["mean_output_tokens"]:.0f} tokens',
             f'  caches     {i["prefix_hit_rate"]:.1%} of prompt tokens hit; prefill queue '
             f'{i["prefill_queue_tokens"]} tokens; decode KV use {i["decode_kv_usage"]:.1%}',
             f'  observed   TTFT {_ms(i["observed_ttft_s"])}, ITL {_ms(i["observed_itl_s"])}']
    rows = [[r["role"], r["current_nodes"], r["wanted_nodes"], r["desired_nodes"], r["reason"]] for r in p["roles"]]
    return "\n".join(lines) + "\n" + table(["ROLE", "NOW", "WANTED", "DESIRED", "WHY"], rows)
