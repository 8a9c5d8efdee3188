"""Cross-node prefix caching through the kv-store: real processes (2 prefill nodes, 1
decode node, the kv-store, meta-server, gateway), Mooncake over TCP, a real Redis.

A prompt's 512-token prefix computed on prefill-0 is put to the store; the next request
with that prefix goes to prefill-1 (round robin), which reads the 32 blocks from the
store instead of computing them, reports them as cached, and still gives exactly the
tokens of a cold run. Then Redis is killed: requests keep succeeding."""
from __future__ import annotations

import asyncio
import time

import pytest

from common.engine import LLM, SamplingParams
from protos.pdmesh.v1 import kv_store_pb2, kv_store_pb2_grpc
from tests.integration.conftest import ENGINE
from tests.integration.test_mesh import assert_no_blocks_in_use, request, stream
from tests.redis_server import RedisServer
from tests.channels import operator_channel_sync

PREFIX = [(7919 * i) % 1000 + 3 for i in range(512)]          # 32 blocks of 16
TAILS = [[(104729 * (k + 1) + 13 * i) % 1000 + 3 for i in range(40)] for k in range(4)]
NODES = (("prefill", "prefill-0"), ("prefill", "prefill-1"), ("decode", "decode-0"))


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def redis(tmp_path_factory):
    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture(scope="module")
def store_mesh(model, start_mesh, redis):
    kv_store = {"port": 0, "capacity_mb": 64, "redis_url": redis.url}
    return start_mesh(model, NODES, top={"kv_store": kv_store}, policy="round_robin")


@pytest.fixture(scope="module")
def cold_tokens(model):
    llm = LLM(str(model), **ENGINE)
    outs = llm.generate([{"prompt_token_ids": PREFIX + t} for t in TAILS],
                        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def store_stats(mesh) -> kv_store_pb2.StatsResponse:
    with operator_channel_sync(mesh.services["kv-store"].address) as ch:
        return kv_store_pb2_grpc.KVStoreStub(ch).Stats(kv_store_pb2.StatsRequest(), timeout=5)


def wait_stored(mesh, num_blocks: int, timeout_s: float = 10.0) -> kv_store_pb2.StatsResponse:
    deadline = time.monotonic() + timeout_s
    while (stats := store_stats(mesh)).blocks_used < num_blocks:
        assert time.monotonic() < deadline, f"store holds {stats.blocks_used} blocks, want {num_blocks}"
        time.sleep(0.05)
    return stats


def generate(mesh, k: int):
    tokens, _, msgs = asyncio.run(stream(mesh.gateway_address, request(PREFIX + TAILS[k], max_tokens=12)))
    return tokens, msgs[-1].usage


def test_prefix_computed_on_one_prefill_node_is_reused_by_another(store_mesh, cold_tokens, redis):
    tokens, usage = generate(store_mesh, 0)                      # prefill-0, cold everywhere
    assert tokens == cold_tokens[0]
    assert usage.cached_prompt_tokens == 0 and usage.prompt_tokens == 552
    wait_stored(store_mesh, 34)                                  # 552 // 16 full blocks

    tokens, usage = generate(store_mesh, 1)                      # prefill-1 reads the prefix
    assert tokens == cold_tokens[1]
    assert usage.cached_prompt_tokens == 512
    stats = store_stats(store_mesh)
    assert stats.hits == 32 and stats.redis_up
    assert_no_blocks_in_use(store_mesh)


def test_requests_succeed_after_redis_is_killed(store_mesh, cold_tokens, redis):
    redis.stop(kill=True)
    try:
        for k in (2, 3):
            tokens, usage = generate(store_mesh, k)
            assert tokens == cold_tokens[k]
            assert usage.cached_prompt_tokens == 512         # both nodes hold the prefix now
        assert_no_blocks_in_use(store_mesh)
    finally:
        redis.start()
