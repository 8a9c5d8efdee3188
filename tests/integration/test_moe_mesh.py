"""A Mixture-of-Experts model (the tiny maker's Qwen3-MoE: 8 experts, top-2) served by real
meshes, tokens exactly the offline TP-1 engine's:

    1P+1D     prefill at TP 2 with its experts placed whole (enable_expert_parallel, 4 a
              rank, tokens dispatched by all_to_all) -> decode at TP 1 (Mooncake over TCP):
              every prompt prefilled remotely, the prefill's rank 0 gathering both ranks'
              KV heads for the one decode cache
    colocated one `both` node at TP 2 with the experts split by columns

and no block stays in use."""
from __future__ import annotations

import asyncio

import pytest

from common.engine import LLM, SamplingParams
from tests.integration.conftest import ENGINE, launch, mesh_dict, mixed_prompts
from tests.integration.test_mesh import MAX_TOKENS, assert_matches_offline, assert_no_blocks_in_use, request, stream
from tests.integration.test_tp_disaggregated import routed

SEED = 23


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("qwen3_moe")


@pytest.fixture(scope="module")
def offline(model) -> list[list[int]]:
    with LLM(str(model), **ENGINE) as llm:
        params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in MAX_TOKENS]
        return [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in mixed_prompts(seed=SEED)], params)]


async def run_all(address: str) -> list:
    reqs = [request(p, max_tokens=m) for p, m in zip(mixed_prompts(seed=SEED), MAX_TOKENS)]
    return await asyncio.gather(*(stream(address, r) for r in reqs))


def test_prefill_ep2_to_decode_tp1(model, offline, tmp_path_factory):
    raw = mesh_dict(model, (("prefill", "p2"), ("decode", "d1")), policy="least_load", local_prefill_max_tokens=0)
    raw["nodes"][0]["engine"] = {"tensor_parallel_size": 2, "enable_expert_parallel": True,
                                 "moe_dispatch": "all_to_all"}
    mesh = launch(tmp_path_factory.mktemp("moe-pd"), raw)
    try:
        results = asyncio.run(run_all(mesh.gateway_address))
        assert all(msgs[0].prefill_timing.remote for _, _, msgs in results), "every prompt prefilled remotely"
        assert routed(mesh) == {"p2": len(results), "d1": len(results)}
        assert_matches_offline(results, offline)
        assert "experts 4 of 8 a rank (expert parallel, all_to_all dispatch)" in (mesh.log_dir / "p2.log").read_text()
        assert_no_blocks_in_use(mesh)
    finally:
        mesh.stop()


def test_colocated_tp2_experts_split_by_columns(model, offline, tmp_path_factory):
    raw = mesh_dict(model, (("both", "both-0"),))
    raw["nodes"][0]["engine"] = {"tensor_parallel_size": 2}
    mesh = launch(tmp_path_factory.mktemp("moe-both"), raw)
    try:
        results = asyncio.run(run_all(mesh.gateway_address))
        assert_matches_offline(results, offline)
        assert "experts 8 of 8 a rank (split by columns)" in (mesh.log_dir / "both-0.log").read_text()
        assert_no_blocks_in_use(mesh)
    finally:
        mesh.stop()
