"""The planner's formula on recorded load inputs (services/meta_server/planner.py), worked by
hand below each case, and its hysteresis and cool-down over a sequence of intervals."""
from __future__ import annotations

import pytest

from services.meta_server.planner import LoadSample, NodeProfile, Planner, PlannerConfig

PROFILE = NodeProfile(
    prefill=((512, 0.2, 4000.0), (2048, 0.6, 5000.0)),                 # (isl, TTFT s idle, tokens/s)
    decode=((1024, 1, 0.02), (1024, 8, 0.04), (1024, 32, 0.1),          # (context, batch, ITL s)
            (4096, 1, 0.03), (4096, 8, 0.06), (4096, 32, 0.16)))
# 10 requests/s over a 30 s interval, 960-token prompts half served by the caches, 128 out:
# isl 480 (below the first point: 4000 tokens/s, 0.2 s), decode context 960 + 64 = 1024
BASE = dict(requests=300, mean_prompt_tokens=960, mean_output_tokens=128, prefix_hit_rate=0.5,
            prefill_nodes=2, decode_nodes=4)


def planner(**cfg) -> Planner:
    return Planner(PlannerConfig(**{"interval_s": 30.0, "ttft_slo_ms": 1000.0, "itl_slo_ms": 100.0, **cfg}), PROFILE)


@pytest.mark.parametrize("sample,cfg,want", [
    # prefill: 10 x 480 = 4800 tokens/s / 4000 -> 2; decode: 1280 tokens/s, ITL 100 ms allows batch 32
    # (0.1 s): 320 tokens/s a node -> 4
    ({}, {}, {"prefill": 2, "decode": 4}),
    # ITL 50 ms: batch 8 + 24 x (0.05 - 0.04) / 0.06 = 12 at 0.05 s: 240 tokens/s -> ceil(5.33) = 6
    ({}, {"itl_slo_ms": 50.0}, {"prefill": 2, "decode": 6}),
    # a 20,000-token queue drained within 1 s - 0.2 s at 4000 tokens/s a node: ceil(6.25) = 7
    ({"prefill_queue_tokens": 20000}, {}, {"prefill": 7, "decode": 4}),
    # observed TTFT 0.8 s where the profile says 0.2 s: correction 4 -> 1000 tokens/s: ceil(4.8) = 5
    ({"observed_ttft_s": 0.8}, {}, {"prefill": 5, "decode": 4}),
    # ... and 9.9 s is clamped to 4 as well
    ({"observed_ttft_s": 9.9}, {}, {"prefill": 5, "decode": 4}),
    # one prefill takes 0.2 s >= a 150 ms SLO: no count meets it, max_nodes
    ({}, {"ttft_slo_ms": 150.0}, {"prefill": 8, "decode": 4}),
    # observed ITL 0.09 s with batch 10 x 128 x 0.09 / 4 = 28.8 a node, where the profile says
    # 0.04 + 0.06 x 20.8 / 24 = 0.092: correction 0.978, target 0.1022 s -> batch 32 (0.1 s): 4
    ({"observed_itl_s": 0.09}, {}, {"prefill": 2, "decode": 4}),
    # observed ITL 0.15 s: batch 48 a node (held at 32's 0.1 s): correction 1.5, target 0.0667 s:
    # batch 8 + 24 x 0.02667 / 0.06 = 18.67 at 0.0667 s: 280 tokens/s -> ceil(4.57) = 5
    ({"observed_itl_s": 0.15}, {}, {"prefill": 2, "decode": 5}),
    # no prefix hits: isl 960 (0.3158 s, 4290.3 tokens/s): 9600 / 4290.3 -> ceil(2.24) = 3
    ({"prefix_hit_rate": 0.0}, {}, {"prefill": 3, "decode": 4}),
    # no requests at all: nothing wanted (the limits keep min_nodes)
    ({"requests": 0}, {}, {"prefill": 0, "decode": 0}),
])
def test_the_formula_on_recorded_inputs(sample, cfg, want):
    wanted, reasons = planner(**cfg).wanted(LoadSample(**{**BASE, **sample}))
    assert wanted == want, reasons
    assert set(reasons) == {"prefill", "decode"}


def test_the_reasons_name_the_numbers():
    _, reasons = planner(ttft_slo_ms=150.0).wanted(LoadSample(**BASE))
    assert reasons["prefill"].startswith("4800 prompt tokens/s (isl 480 after a 50% hit rate) at 4000 tokens/s a node")
    assert "one 480-token prefill takes 200 ms >= the TTFT SLO 150 ms: no node count meets it: 8" in reasons["prefill"]
    assert reasons["decode"] == ("1280 output tokens/s at 320 tokens/s a node for ITL 100 ms at context 1024 "
                                 "(correction 1.00): 4")


def test_it_grows_at_once_and_shrinks_one_node_after_three_quiet_intervals_and_the_cool_down():
    p = planner(scale_down_after=3, cooldown_s=100.0, min_nodes=1, max_nodes=8)
    quiet = dict(BASE, requests=60)                 # 2 requests/s: 256 output tokens/s -> 1 decode node
    steps = []
    decode_nodes = 4
    for t in (0, 10, 20, 30, 40, 50, 130):
        d = p.decide(LoadSample(**{**quiet, "decode_nodes": decode_nodes}), now=t)
        steps.append(d.nodes["decode"])
        decode_nodes = d.nodes["decode"]
    # 3 intervals below -> 3; the count restarts; at 50 three below again but 30 s after the
    # change (cooling down); at 130 out of it -> 2
    assert steps == [4, 4, 3, 3, 3, 3, 2]
    d = p.decide(LoadSample(**{**BASE, "requests": 900, "decode_nodes": 2}), now=131)   # 3x the base load
    assert d.nodes["decode"] == 8 and d.wanted["decode"] == 12        # at once, within the cool-down, capped


def test_a_kept_count_says_why():
    p = planner(scale_down_after=2, cooldown_s=0.0)
    d = p.decide(LoadSample(**{**BASE, "requests": 60}), now=0.0)
    assert d.nodes == {"prefill": 2, "decode": 4}
    assert d.reasons["decode"].endswith("; kept 4: 1 of 2 intervals below")
    assert d.reasons["prefill"].endswith("; kept 2: 1 of 2 intervals below")


@pytest.mark.parametrize("cfg,error", [
    ({"interval_s": 0}, "meta_server.planner.interval_s must be > 0, got 0"),
    ({"min_nodes": 3, "max_nodes": 2}, "meta_server.planner needs 0 <= min_nodes <= max_nodes, got 3 and 2"),
    ({"scale_down_after": 0}, "scale_down_after must be >= 1"),
])
def test_bad_settings_are_refused_naming_the_field(cfg, error):
    with pytest.raises(ValueError, match=error):
        PlannerConfig(**cfg)
