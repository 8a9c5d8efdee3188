"""`pdmesh bench serve`'s parts: exact metrics on known timings (vllm bench serve's
definitions), goodput, the datasets (seeded, bounded, shared prefixes), arrivals."""
from __future__ import annotations

import math

import pytest

from services.bench import datasets
from services.bench.metrics import RequestResult, parse_goodput, summarize
from services.bench.runner import arrival_gaps


def test_summary_is_vllm_s_definitions_on_known_timings():
    results = [
        RequestResult(num_prompt_tokens=10, num_output_tokens=5, ttft_s=0.1, e2e_s=0.5, itl_s=[0.1, 0.1, 0.1, 0.1]),
        RequestResult(num_prompt_tokens=20, num_output_tokens=3, ttft_s=0.3, e2e_s=0.7, itl_s=[0.2, 0.2]),
        RequestResult(num_prompt_tokens=30, num_output_tokens=1, ttft_s=0.2, e2e_s=0.2),
        RequestResult(num_prompt_tokens=40, error="UNAVAILABLE"),
    ]
    s = summarize(results, duration_s=2.0, slos={"ttft": 250.0, "tpot": 150.0})
    assert (s["num_requests"], s["completed"], s["failed"], s["errors"]) == (4, 3, 1, ["UNAVAILABLE"])
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (60, 9)
    assert s["request_throughput"] == 1.5 and s["output_throughput"] == 4.5
    assert s["ttft"]["mean_ms"] == pytest.approx(200.0) and s["ttft"]["median_ms"] == pytest.approx(200.0)
    assert s["ttft"]["p90_ms"] == pytest.approx(280.0) and s["ttft"]["p99_ms"] == pytest.approx(298.0)
    # TPOT: (0.5 - 0.1) / 4 = 100 ms and (0.7 - 0.3) / 2 = 200 ms; a 1-token request has none
    assert s["tpot"]["mean_ms"] == pytest.approx(150.0) and s["tpot"]["median_ms"] == pytest.approx(150.0)
    assert s["itl"]["mean_ms"] == pytest.approx(800 / 6)
    assert s["e2e"]["median_ms"] == pytest.approx(500.0)
    # goodput: request 0 meets both (100 <= 250, 100 <= 150), 1 misses both, 2 meets ttft (tpot n/a)
    assert s["request_goodput"] == pytest.approx(2 / 2.0)
    assert "handoff" not in s      # no server said how long a remote prefill took


def test_handoff_is_ttft_minus_the_reported_remote_prefill():
    results = [
        RequestResult(num_output_tokens=2, ttft_s=0.30, e2e_s=0.4, remote_prefill_s=0.28),
        RequestResult(num_output_tokens=2, ttft_s=0.50, e2e_s=0.6, remote_prefill_s=0.46),
        RequestResult(num_output_tokens=2, ttft_s=0.10, e2e_s=0.2),          # prefilled locally
        RequestResult(error="UNAVAILABLE", remote_prefill_s=0.1),
    ]
    s = summarize(results, duration_s=1.0)
    assert s["handoff"]["requests"] == 2
    assert s["handoff"]["mean_ms"] == pytest.approx(30.0) and s["handoff"]["median_ms"] == pytest.approx(30.0)


def test_goodput_slos_are_parsed_naming_the_allowed_names():
    assert parse_goodput(["ttft:500", "tpot:50.5", "e2e:9000"]) == {"ttft": 500.0, "tpot": 50.5, "e2e": 9000.0}
    for bad, message in (("itl:5", "one of ttft, tpot, e2e"), ("ttft", "NAME:MS"), ("tpot:fast", "not a number"),
                         ("ttft:0", "> 0")):
        with pytest.raises(ValueError, match=message):
            parse_goodput([bad])


def test_random_requests_are_seeded_and_fit_the_model():
    a = datasets.random_requests(50, 190, 65, vocab_size=640, sigma=0.5, seed=3, max_model_len=256)
    assert a == datasets.random_requests(50, 190, 65, vocab_size=640, sigma=0.5, seed=3, max_model_len=256)
    assert a != datasets.random_requests(50, 190, 65, vocab_size=640, sigma=0.5, seed=4, max_model_len=256)
    assert all(r.num_prompt_tokens + r.max_tokens <= 256 and r.max_tokens >= 1 for r in a)
    assert all(datasets.FIRST_ID <= i < 640 for r in a for i in r.prompt_token_ids)
    assert len({r.num_prompt_tokens for r in a}) > 10          # lengths spread
    fixed = datasets.random_requests(5, 32, 8, vocab_size=640, sigma=0.0)
    assert [(r.num_prompt_tokens, r.max_tokens) for r in fixed] == [(32, 8)] * 5


def test_shared_prefix_requests_share_their_group_s_system_prompt():
    reqs = datasets.shared_prefix_requests(3, 4, system_len=48, question_len=16, output_len=8, vocab_size=640, seed=1)
    assert len(reqs) == 12 and all(r.num_prompt_tokens == 64 and r.max_tokens == 8 for r in reqs)
    prefixes = {}
    for r in reqs:
        prefixes.setdefault(r.group, set()).add(r.prompt_token_ids[:48])
    assert sorted(prefixes) == [0, 1, 2] and all(len(p) == 1 for p in prefixes.values())
    assert len({next(iter(p)) for p in prefixes.values()}) == 3
    assert [r.group for r in reqs] != sorted(r.group for r in reqs)     # groups interleave


def test_jsonl_requests_take_text_or_ids_and_name_a_bad_line(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "hello there", "max_tokens": 5}\n\n{"prompt_token_ids": [5, 6, 7], "ignore_eos": false}\n')
    reqs = datasets.jsonl_requests(path, output_len=9)
    assert [(r.prompt, r.prompt_token_ids, r.max_tokens, r.ignore_eos) for r in reqs] == [
        ("hello there", (), 5, True), ("", (5, 6, 7), 9, False)]
    path.write_text('{"prompt": "ok"}\n{"text": "no"}\n')
    with pytest.raises(ValueError, match=r"prompts.jsonl:2: needs a non-empty"):
        datasets.jsonl_requests(path, output_len=9)


def test_arrivals_are_poisson_seeded_or_all_at_once():
    gaps = arrival_gaps(200, 4.0, seed=7)
    assert gaps == arrival_gaps(200, 4.0, seed=7) and gaps[0] == 0.0 and all(g > 0 for g in gaps[1:])
    assert arrival_gaps(5, math.inf, seed=7) == [0.0] * 5
    with pytest.raises(ValueError, match="must be > 0"):
        arrival_gaps(3, 0.0, seed=1)
