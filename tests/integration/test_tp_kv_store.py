"""The kv-store across tensor-parallel prefill nodes (issue 16): two prefill nodes at TP 2,
a decode node at TP 2, the kv-store, Mooncake over TCP.

Each rank stores its own KV heads in a key space of its own (KeySpace.head_offset 0 and
2 of the tiny llama's 4 heads). A 512-token prefix computed on one prefill node is put by
both of its ranks; the next request with that prefix goes to the other node (round
robin), whose two ranks each read their 32 blocks from the store (the worker's read is
counted in its node's rank_bytes_read and, with rank 0's, in its Prometheus
kv_transfer_bytes_total), and still gives exactly the offline engine's
tokens: a rank that loaded another's heads, or none, would change them. The store refuses
a key space whose head offset no rank of a live node has."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from common.engine import LLM, SamplingParams
from common.kv_layout import KVLayout
from protos.pdmesh.v1 import kv_store_pb2, kv_store_pb2_grpc
from tests.channels import operator_channel_sync
from tests.integration.conftest import ENGINE, engine_stats, launch, mesh_dict
from services.node.grpc_util import free_port
from tests.integration.test_kv_store_mesh import PREFIX, TAILS, store_stats, wait_stored
from tests.integration.test_metrics_mesh import scrape, total
from tests.integration.test_mesh import assert_no_blocks_in_use, request, stream
from tests.integration.test_tp_mesh import members

NODES = (("prefill", "p2a"), ("prefill", "p2b"), ("decode", "d2"))


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama")      # 4 KV heads: 2 a rank at TP 2


@pytest.fixture(scope="module")
def mesh(model, tmp_path_factory):
    raw = mesh_dict(model, NODES, policy="round_robin", top={"kv_store": {"port": 0, "capacity_mb": 64}})
    for node in raw["nodes"]:
        node["engine"] = {"tensor_parallel_size": 2}
        node["metrics_port"] = free_port()
    m = launch(tmp_path_factory.mktemp("tp-store"), raw)
    yield m
    m.stop()


@pytest.fixture(scope="module")
def cold_tokens(model):
    llm = LLM(str(model), **ENGINE)
    outs = llm.generate([{"prompt_token_ids": PREFIX + t} for t in TAILS[:2]],
                        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def generate(mesh, k: int):
    tokens, _, msgs = asyncio.run(stream(mesh.gateway_address, request(PREFIX + TAILS[k], max_tokens=12)))
    return tokens, msgs[-1].usage, msgs[0].prefill_timing


def why_no_read(mesh, timing) -> str:
    """What a miss of the store's prefix looked like: where the prompt was prefilled, the
    store's counts, and the prefill nodes' log lines about the store or their refusals."""
    store = store_stats(mesh)
    lines = [line.strip() for node_id in ("p2a", "p2b")
             for line in (mesh.log_dir / f"{node_id}.log").read_text(errors="replace").splitlines()
             if " pdmesh." in line and any(w in line for w in ("kv-store", "refused", "failed", "stalled"))]
    return (f"; prefilled remotely {timing.remote}; store hits {store.hits}, misses {store.misses}, "
            f"expired pins {store.expired_pins}; prefill nodes' log: {lines[-6:]}")


def prefill_stats(mesh) -> dict[str, object]:
    return {node_id: engine_stats(mesh.services[node_id].address, "prefill") for node_id in ("p2a", "p2b")}


def test_each_rank_stores_and_loads_its_own_heads(mesh, cold_tokens):
    layout = KVLayout.from_proto(members(mesh)["p2a"].kv_layout)
    assert layout.num_kv_heads == 2
    stats0, read0 = store_stats(mesh), prefill_stats(mesh)
    tokens, usage, _ = generate(mesh, 0)                         # cold everywhere
    assert tokens == cold_tokens[0]
    assert usage.cached_prompt_tokens == 0
    stats = wait_stored(mesh, 2 * 34, since=stats0)              # 552 // 16 full blocks, per rank
    assert stats.num_spaces == 2
    before = prefill_stats(mesh)
    assert all(before[n].rank_bytes_read == read0[n].rank_bytes_read for n in before), "a cold prompt reads nothing"

    tokens, usage, timing = generate(mesh, 1)                    # the other node reads the prefix
    assert tokens == cold_tokens[1]
    assert usage.cached_prompt_tokens == 512, why_no_read(mesh, timing)
    assert store_stats(mesh).hits - stats0.hits == 2 * 32        # both ranks' spaces
    after = prefill_stats(mesh)
    per_rank = 32 * layout.num_layers * 2 * layout.block_bytes   # the worker's 32 blocks, K and V
    loaded = {n: after[n].rank_bytes_read - before[n].rank_bytes_read for n in after}
    assert sorted(loaded.values()) == [0, per_rank]
    reader = next(n for n, b in loaded.items() if b)
    assert after[reader].transfer_bytes_read - before[reader].transfer_bytes_read == 2 * per_rank
    for node_id, stats in after.items():   # Prometheus counts every rank's bytes too
        samples = scrape(mesh, node_id)
        assert total(samples, "pdmesh:kv_transfer_bytes_total", direction="read") == stats.transfer_bytes_read
        assert total(samples, "pdmesh:kv_transfer_bytes_total", direction="write") == stats.transfer_bytes_written
        assert stats.transfer_bytes_written > stats.rank_bytes_written > 0
    assert_no_blocks_in_use(mesh)


def test_a_head_offset_no_rank_has_is_refused(mesh):
    layout = members(mesh)["p2a"].kv_layout
    with operator_channel_sync(mesh.services["kv-store"].address) as ch:
        stub = kv_store_pb2_grpc.KVStoreStub(ch)
        put = lambda offset: stub.ReservePut(kv_store_pb2.ReservePutRequest(   # noqa: E731
            space=kv_store_pb2.KeySpace(model_id=members(mesh)["p2a"].model_id, layout=layout,
                                        head_offset=offset),
            block_hashes=[b"\x01" * 16], token_ids=list(range(16))), timeout=5)
        with pytest.raises(grpc.RpcError) as bad:
            put(1)                                               # not a multiple of 2 heads
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "space.head_offset must be a non-negative multiple of layout.num_kv_heads (2), got 1" in bad.value.details()
        with pytest.raises(grpc.RpcError) as none:
            put(4)                                               # ranks hold heads 0-1 and 2-3
        assert none.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "at head offset 4" in none.value.details()
