"""`pdmesh bench serve` as a user runs it, against a real mesh (meta-server, one `both`
node, gateway; its API key as the launcher made it): every request completes with exactly
its max_tokens, the JSON holds one run per rate with the metrics, the PNG is a PNG, and a
shared-prefix dataset really shares its prefixes (the node's prefix cache hits)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.conftest import engine_stats

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def mesh(start_mesh, tiny_model):
    return start_mesh(tiny_model("llama"), nodes=(("both", "both-0"),))


def bench(mesh, tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "serving.json"
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "bench", "serve", "--gateway", mesh.gateway_address,
         "--api-key-file", mesh.environ["PDMESH_API_KEYS_FILE"], "--out", str(out), "--warmup", "1", *args],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, json.loads(out.read_text())


def test_random_dataset_at_two_rates(mesh, tmp_path):
    proc, report = bench(mesh, tmp_path, "--num-prompts", "8", "--random-input-len", "40", "--random-output-len",
                         "6", "--request-rate", "4,inf", "--goodput", "ttft:60000", "tpot:60000", "--seed", "5",
                         "--save-detailed")
    assert [run["rate"] for run in report["runs"]] == [4.0, "inf"]
    assert report["command"].startswith("pdmesh bench serve --gateway ") and report["backend"] == "grpc"
    assert report["machine"]["cpus"] >= 1 and len(report["machine"]["load_avg"]) == 3
    wanted = sum(report["dataset"]["output_tokens"])
    for run in report["runs"]:
        assert (run["num_requests"], run["completed"], run["failed"]) == (8, 8, 0)
        assert run["total_output_tokens"] == wanted
        assert run["total_input_tokens"] == sum(report["dataset"]["prompt_tokens"])
        assert run["request_goodput"] == pytest.approx(run["request_throughput"])   # SLOs nobody misses
        assert 0 < run["ttft"]["median_ms"] <= run["ttft"]["p99_ms"] <= run["e2e"]["p99_ms"]
        assert set(run["tpot"]) == {"mean_ms", "median_ms", "p90_ms", "p99_ms"}
        assert [len(r["output_token_ids"]) for r in run["requests"]] == report["dataset"]["output_tokens"]
    assert [r["output_token_ids"] for r in report["runs"][0]["requests"]] == \
        [r["output_token_ids"] for r in report["runs"][1]["requests"]]          # greedy: the same at any rate
    assert (tmp_path / "serving.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert proc.stdout.count("8/8 ok") == 2


def test_shared_prefix_dataset_hits_the_prefix_cache(mesh, tmp_path):
    before = engine_stats(mesh.services["both-0"].address, "both").prefix_hit_tokens
    _, report = bench(mesh, tmp_path, "--dataset", "shared-prefix", "--sp-num-groups", "2",
                      "--sp-prompts-per-group", "3", "--sp-system-len", "64", "--sp-question-len", "8",
                      "--sp-output-len", "4", "--request-rate", "inf")
    run = report["runs"][0]
    assert (run["completed"], run["total_output_tokens"]) == (6, 24)
    assert report["dataset"]["prompt_tokens"] == [72] * 6
    assert engine_stats(mesh.services["both-0"].address, "both").prefix_hit_tokens - before >= 64


def test_jsonl_text_prompts(mesh, tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "The quick brown fox", "max_tokens": 3}\n{"prompt": "Hello there"}\n')
    _, report = bench(mesh, tmp_path, "--dataset", "jsonl", "--dataset-path", str(path), "--random-output-len", "5",
                      "--request-rate", "inf")
    run = report["runs"][0]
    assert (run["completed"], run["total_output_tokens"]) == (2, 8)
    assert run["total_input_tokens"] > 0      # counted by the gateway's tokenizer


def test_a_1p1d_mesh_reports_the_handoff_of_every_remote_prefill(start_mesh, tiny_model, tmp_path):
    """The gateway's PrefillTiming reaches the report: every request was prefilled on the
    prefill node (remote), and the hand-off is TTFT minus its queue + compute + transfer."""
    pd = start_mesh(tiny_model("llama"), nodes=(("prefill", "prefill-0"), ("decode", "decode-0")))
    proc, report = bench(pd, tmp_path, "--num-prompts", "4", "--random-input-len", "40",
                         "--random-output-len", "4", "--request-rate", "inf", "--seed", "3", "--plot", "none")
    (run,) = report["runs"]
    assert (run["completed"], run["handoff"]["requests"]) == (4, 4)
    assert 0 < run["handoff"]["median_ms"] <= run["ttft"]["p99_ms"]
    assert "over 4 remote prefills" in proc.stdout
