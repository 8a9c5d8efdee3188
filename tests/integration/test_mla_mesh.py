"""A tiny DeepSeek-V3 (MLA over a latent cache, layers/mla.py; MoE layers) served
disaggregated across tensor-parallel sizes (issue 30): prefill nodes p2 (TP 2) and p1
(TP 1), decode nodes d2 (TP 2) and d1 (TP 1), Mooncake over TCP. Every rank of a node
holds the same latent cache, so every pair is served, p1 -> d2 too (refused for a GQA
model: tests/integration/test_tp_disaggregated.py): decode rank j gets its copy, whole
blocks, from prefill rank j % p. Each phase leaves one pair in routing; 16 concurrent
requests must all be prefilled remotely and give exactly the offline engine's tokens, and
the bytes pushed are the latent's: num_layers x (kv_lora_rank + qk_rope_head_dim) values a
prompt token and decode rank, not a per-head K and V."""
from __future__ import annotations

import asyncio

import pytest

from common.engine import LLM, SamplingParams
from tests.integration.conftest import ENGINE, engine_stats, launch, mesh_dict, mixed_prompts
from tests.integration.test_mesh import MAX_TOKENS, assert_matches_offline, assert_no_blocks_in_use
from tests.integration.test_tp_disaggregated import only, routed, run_phase
from tests.integration.test_tp_mesh import members
from tests.mla_checkpoints import COMMON, save

NODES = (("prefill", "p2"), ("prefill", "p1"), ("decode", "d2"), ("decode", "d1"))
TP2 = ("p2", "d2")
PHASES = {("p2", "d1"): 21, ("p1", "d2"): 22, ("p2", "d2"): 23}
LATENT_BYTES = COMMON["num_hidden_layers"] * (COMMON["kv_lora_rank"] + COMMON["qk_rope_head_dim"]) * 4   # float32


@pytest.fixture(scope="module")
def model(tmp_path_factory, tiny_model):
    out = tmp_path_factory.mktemp("deepseek_v3")
    save("deepseek_v3", out, tiny_model("llama"))
    return out


@pytest.fixture(scope="module")
def offline(model) -> dict[int, list[list[int]]]:
    with LLM(str(model), **ENGINE) as llm:
        params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in MAX_TOKENS]
        return {seed: [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in mixed_prompts(seed=seed)], params)] for seed in PHASES.values()}


@pytest.fixture(scope="module")
def mesh(model, tmp_path_factory):
    raw = mesh_dict(model, NODES, policy="least_load", local_prefill_max_tokens=0)
    for node in raw["nodes"]:
        if node["node_id"] in TP2:
            node["engine"] = {"tensor_parallel_size": 2}
    m = launch(tmp_path_factory.mktemp("mla-pd"), raw)
    yield m
    m.stop()


def test_every_rank_publishes_the_same_latent_cache(mesh):
    found = members(mesh)
    for node_id in TP2:
        ranks = found[node_id].kv_ranks
        assert [(r.layout.kind, r.layout.num_kv_heads, r.layout.head_dim) for r in ranks] == [("latent", 1, 40)] * 2
    for node_id in ("p1", "d1"):
        layout = found[node_id].kv_layout
        assert (layout.kind, layout.num_kv_heads, layout.head_dim) == ("latent", 1, 40)


@pytest.mark.parametrize("prefill,decode", list(PHASES))
def test_any_prefill_tp_pushes_into_any_decode_tp(mesh, offline, prefill, decode):
    only(mesh, {prefill, decode})
    svc = mesh.services[prefill]
    before, stats_before = routed(mesh), engine_stats(svc.address, svc.role)
    seed = PHASES[prefill, decode]
    results = asyncio.run(run_phase(mesh.gateway_address, seed))
    after, stats_after = routed(mesh), engine_stats(svc.address, svc.role)
    assert all(msgs[0].prefill_timing.remote for _, _, msgs in results), "every prompt prefilled remotely"
    assert after[prefill] - before.get(prefill, 0) == len(results)
    assert after[decode] - before.get(decode, 0) == len(results)
    assert_matches_offline(results, offline[seed])
    # every prompt token's latent, once per decode rank, and nothing else
    decode_ranks = 2 if decode == "d2" else 1
    prompt_tokens = sum(len(p) for p in mixed_prompts(seed=seed))
    pushed = stats_after.transfer_bytes_written - stats_before.transfer_bytes_written
    assert pushed == prompt_tokens * LATENT_BYTES * decode_ranks
    rank_bytes = stats_after.rank_bytes_written - stats_before.rank_bytes_written
    staged = stats_after.kv_blocks_staged - stats_before.kv_blocks_staged
    # p2 -> d2: rank 1 writes decode rank 1's copy from its own process; p2 -> d1: rank 0 alone
    assert rank_bytes == (pushed // 2 if (prefill, decode) == ("p2", "d2") else 0)
    assert staged == 0
    assert_no_blocks_in_use(mesh)
