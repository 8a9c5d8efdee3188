"""KV moving between prefill and decode nodes of different tensor-parallel sizes (issue 16),
in one mesh: prefill nodes p2 (TP 2) and p1 (TP 1), decode nodes d2 (TP 2) and d1 (TP 1),
Mooncake over TCP. Draining the others, each phase leaves one pair in routing:

    p2 -> d2   rank i writes rank i (whole blocks)
    p2 -> d1   p2's rank 0 gathers both ranks' heads and writes d1's one cache whole
               (staged; head slices, a write per token slot, only when staging is full)
    p1 -> d1   the TP-1 path

and 16 concurrent requests through the gateway must all be prefilled remotely (the path
ran) and give exactly the offline engine's tokens: a decode rank's heads that a prefill
rank had not written would change them. p1 -> d2 (prefill TP < decode TP) cannot be
served: the router refuses the pair with a message naming both sizes and d2 prefills
locally, so the requests are served, never hung. Every node ends with no block in use."""
from __future__ import annotations

import asyncio

import pytest

from common.engine import LLM, SamplingParams
from protos.pdmesh.v1 import meta_pb2, meta_pb2_grpc
from tests.integration.conftest import ENGINE, engine_stats, launch, mesh_dict, mixed_prompts
from tests.integration.test_mesh import MAX_TOKENS, assert_matches_offline, assert_no_blocks_in_use, request, stream
from tests.integration.test_tp_mesh import members, rank_workers

NODES = (("prefill", "p2"), ("prefill", "p1"), ("decode", "d2"), ("decode", "d1"))
TP2 = ("p2", "d2")
# each phase its own prompts, so that no decode node holds them in its prefix cache from
# an earlier phase (a hit would leave less of the prompt to push)
PHASES = {("p2", "d2"): 11, ("p2", "d1"): 12, ("p1", "d1"): 13, ("p1", "d2"): 14}


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama")      # 4 KV heads: 2 a rank at TP 2


@pytest.fixture(scope="module")
def offline(model) -> dict[int, list[list[int]]]:
    """Prompt seed -> the offline TP-1 engine's tokens for mixed_prompts(seed=...)."""
    llm = LLM(str(model), **ENGINE)
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in MAX_TOKENS]
    return {seed: [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in mixed_prompts(seed=seed)], params)] for seed in PHASES.values()}


async def run_phase(address: str, seed: int) -> list:
    """16 concurrent requests of mixed_prompts(seed=seed) through the gateway."""
    reqs = [request(p, max_tokens=m) for p, m in zip(mixed_prompts(seed=seed), MAX_TOKENS)]
    return await asyncio.gather(*(stream(address, r) for r in reqs))


@pytest.fixture(scope="module")
def mesh(model, tmp_path_factory):
    raw = mesh_dict(model, NODES, policy="least_load", local_prefill_max_tokens=0)
    for node in raw["nodes"]:
        if node["node_id"] in TP2:
            node["engine"] = {"tensor_parallel_size": 2}
    m = launch(tmp_path_factory.mktemp("tp-pd"), raw)
    yield m
    m.stop()


def only(mesh, keep: set[str]) -> None:
    """Drain every engine node but `keep`, undrain those."""
    with mesh.admin_channel() as ch:
        admin = meta_pb2_grpc.MetaAdminStub(ch)
        for _, node_id in NODES:
            if node_id in keep:
                admin.UndrainNode(meta_pb2.UndrainNodeRequest(node_id=node_id), timeout=5)
            else:
                admin.DrainNode(meta_pb2.DrainNodeRequest(node_id=node_id), timeout=5)


def routed(mesh) -> dict[str, int]:
    with mesh.admin_channel() as ch:
        stats = meta_pb2_grpc.MetaAdminStub(ch).GetStats(meta_pb2.GetStatsRequest(), timeout=5)
    return {n.node_id: n.num_routed for n in stats.nodes}


def p2_stats(mesh):
    svc = mesh.services["p2"]
    return engine_stats(svc.address, svc.role)


def test_the_mesh_publishes_one_kv_cache_per_rank(mesh):
    found = members(mesh)
    for node_id in TP2:
        info = found[node_id]
        assert info.tensor_parallel_size == 2 and len(info.kv_ranks) == 2
        assert [r.layout.num_kv_heads for r in info.kv_ranks] == [2, 2]
        assert info.kv_ranks[0].transfer_endpoint == info.transfer_endpoint
        assert info.kv_ranks[1].transfer_endpoint not in (info.transfer_endpoint, "")
        assert len(rank_workers(mesh.services[node_id].process.pid)) == 1
    for node_id in ("p1", "d1"):
        assert found[node_id].kv_layout.num_kv_heads == 4 and not found[node_id].kv_ranks


@pytest.mark.parametrize("prefill,decode", [("p2", "d2"), ("p2", "d1"), ("p1", "d1")])
def test_each_pair_of_sizes_serves_the_offline_tokens(mesh, offline, prefill, decode):
    only(mesh, {prefill, decode})
    before, p2_before = routed(mesh), p2_stats(mesh)
    seed = PHASES[prefill, decode]
    results = asyncio.run(run_phase(mesh.gateway_address, seed))
    after, p2_after = routed(mesh), p2_stats(mesh)
    assert all(msgs[0].prefill_timing.remote for _, _, msgs in results), "every prompt prefilled remotely"
    assert after[prefill] - before.get(prefill, 0) == len(results)
    assert after[decode] - before.get(decode, 0) == len(results)
    assert_matches_offline(results, offline[seed])
    rank_bytes = p2_after.rank_bytes_written - p2_before.rank_bytes_written
    staged = p2_after.kv_blocks_staged - p2_before.kv_blocks_staged
    if (prefill, decode) == ("p2", "d2"):      # rank 1 wrote its heads from its own process
        assert rank_bytes > 0 and staged == 0
    elif (prefill, decode) == ("p2", "d1"):    # gathered to rank 0, pushed as whole blocks
        assert rank_bytes == 0 and staged >= len(results)
    else:
        assert rank_bytes == 0 and staged == 0
    assert_no_blocks_in_use(mesh)


def test_a_prefill_node_of_lower_tp_is_refused_at_routing_and_the_decode_node_prefills(mesh, offline):
    only(mesh, {"p1", "d2"})
    seed = PHASES["p1", "d2"]
    results = asyncio.run(run_phase(mesh.gateway_address, seed))
    assert not any(msgs[0].prefill_timing.remote for _, _, msgs in results)
    assert_matches_offline(results, offline[seed])
    log = (mesh.log_dir / "meta-server.log").read_text()
    assert ("prefill node p1 cannot push into decode node d2: prefill TP 1 < decode TP 2: a prefill rank "
            "would split its KV heads over decode ranks") in log
    assert_no_blocks_in_use(mesh)


def test_the_grpc_transfer_carries_every_rank_s_kv_too(model, offline, tmp_path_factory):
    """prefill TP 2 -> decode TP 2 over the `grpc` transfer (hosts without Mooncake): each
    worker rank serves KVTransfer on its own port with the mesh's credentials and writes
    into its peer rank's."""
    raw = mesh_dict(model, (("prefill", "p2"), ("decode", "d2")), transfer="grpc", policy="least_load",
                    local_prefill_max_tokens=0)
    for node in raw["nodes"]:
        node["engine"] = {"tensor_parallel_size": 2}
    m = launch(tmp_path_factory.mktemp("tp-pd-grpc"), raw)
    try:
        found = members(m)
        assert [r.layout.num_kv_heads for r in found["d2"].kv_ranks] == [2, 2]
        seed = PHASES["p2", "d2"]
        results = asyncio.run(run_phase(m.gateway_address, seed))
        assert all(msgs[0].prefill_timing.remote for _, _, msgs in results)
        assert_matches_offline(results, offline[seed])
        svc = m.services["p2"]
        assert engine_stats(svc.address, svc.role).rank_bytes_written > 0
        assert_no_blocks_in_use(m)
    finally:
        m.stop()
