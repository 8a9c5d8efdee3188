"""Cross-node prefix caching through the kv-store: real processes (2 prefill nodes, 1
decode node, the kv-store, meta-server, gateway), Mooncake over TCP, a real Redis.

A prompt's 512-token prefix computed on one prefill node is put to the store; the next
request with that prefix goes to the other prefill node (round robin), which reads the
32 blocks from the store instead of computing them, reports them as cached, and still
gives exactly the tokens of a cold run. Then Redis is killed: requests keep succeeding.
Each test sends a prefix of its own, so what another test left cached changes nothing."""
from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter

import pytest

from common.engine import LLM, SamplingParams
from protos.pdmesh.v1 import kv_store_pb2, kv_store_pb2_grpc, meta_pb2, meta_pb2_grpc
from tests.integration.conftest import ENGINE, engine_stats
from tests.integration.test_mesh import assert_no_blocks_in_use, kv_bytes, request, stream
from tests.redis_server import RedisServer
from tests.channels import operator_channel_sync


def prefix(salt: int) -> list[int]:
    """512 tokens (32 blocks of 16); each salt its own first block, so its own chain."""
    return [(7919 * i + 101 * salt) % 1000 + 3 for i in range(512)]


PREFIX = prefix(0)
TAILS = [[(104729 * (k + 1) + 13 * i) % 1000 + 3 for i in range(40)] for k in range(4)]
NODES = (("prefill", "prefill-0"), ("prefill", "prefill-1"), ("decode", "decode-0"))
PREFILL_NODES = [node_id for role, node_id in NODES if role == "prefill"]
HANG_GUARD_S = 60.0   # only catches a hang: a loaded machine may take many seconds
_probes = itertools.count()


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
    """cold_tokens(prompts) -> the offline engine's 12 greedy tokens of each prompt."""
    llm = LLM(str(model), **ENGINE)

    def run(prompts: list[list[int]]) -> list[list[int]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
        return [o.outputs[0].token_ids for o in outs]

    return run


def store_stats(mesh) -> kv_store_pb2.StatsResponse:
    with operator_channel_sync(mesh.services["kv-store"].address) as ch:
        return kv_store_pb2_grpc.KVStoreStub(ch).Stats(kv_store_pb2.StatsRequest(), timeout=5)


def wait_stored(mesh, num_blocks: int, timeout_s: float = HANG_GUARD_S,
                since: kv_store_pb2.StatsResponse | None = None) -> kv_store_pb2.StatsResponse:
    """Waits until the store holds num_blocks blocks (more than `since` did, when given)."""
    base = since.blocks_used if since is not None else 0
    deadline = time.monotonic() + timeout_s
    while (stats := store_stats(mesh)).blocks_used - base < num_blocks:
        assert time.monotonic() < deadline, f"store holds {stats.blocks_used - base} new blocks, want {num_blocks}"
        time.sleep(0.05)
    return stats


def routed(mesh) -> Counter:
    """Requests the meta-server has routed to each node (prefill or decode) so far."""
    with operator_channel_sync(mesh.meta_address) as ch:
        stats = meta_pb2_grpc.MetaAdminStub(ch).GetStats(meta_pb2.GetStatsRequest(), timeout=5)
    return Counter({n.node_id: n.num_routed for n in stats.nodes})


def generate(mesh, prompt: list[int], max_tokens: int = 12):
    tokens, _, msgs = asyncio.run(stream(mesh.gateway_address, request(prompt, max_tokens=max_tokens)))
    return tokens, msgs[-1].usage


def generate_on(mesh, prompt: list[int]):
    """(tokens, usage, the prefill node that served it), from the routed counts."""
    before = routed(mesh)
    tokens, usage = generate(mesh, prompt)
    [node] = [n for n in PREFILL_NODES if routed(mesh)[n] > before[n]]
    return tokens, usage, node


def bytes_read(mesh) -> dict[str, int]:
    return {n: engine_stats(mesh.services[n].address, "prefill").transfer_bytes_read for n in PREFILL_NODES}


def test_prefix_computed_on_one_prefill_node_is_reused_by_another(store_mesh, model, cold_tokens, redis):
    prompts = [prefix(1) + TAILS[0], prefix(1) + TAILS[1]]
    want = cold_tokens(prompts)
    stats0, read0 = store_stats(store_mesh), bytes_read(store_mesh)
    tokens, usage, writer = generate_on(store_mesh, prompts[0])       # cold everywhere
    assert tokens == want[0]
    assert usage.cached_prompt_tokens == 0 and usage.prompt_tokens == 552
    wait_stored(store_mesh, 34, since=stats0)                          # 552 // 16 full blocks

    tokens, usage, reader = generate_on(store_mesh, prompts[1])       # the other node reads the prefix
    assert reader != writer
    assert tokens == want[1]
    assert usage.cached_prompt_tokens == 512
    stats = store_stats(store_mesh)
    assert stats.hits - stats0.hits == 32 and stats.redis_up
    read = {n: b - read0[n] for n, b in bytes_read(store_mesh).items()}
    assert read == {writer: 0, reader: kv_bytes(model, 512)}, "the reader's 32 blocks came from the store"
    assert_no_blocks_in_use(store_mesh)


def wait_redis_back(mesh) -> None:
    """Sends fresh prompts (store misses: the store asks Redis, at most every retry_s)
    until the store sees Redis up again, as the other tests expect."""
    deadline = time.monotonic() + HANG_GUARD_S
    while not store_stats(mesh).redis_up:
        assert time.monotonic() < deadline, f"the kv-store never saw Redis again: {store_stats(mesh)}"
        n = next(_probes)
        generate(mesh, list(range(3 + n, 3 + n + 32)), max_tokens=1)
        time.sleep(0.2)


def test_requests_succeed_after_redis_is_killed(store_mesh, cold_tokens, redis):
    prompts = [prefix(2) + t for t in TAILS[:3]]
    want = cold_tokens(prompts)
    stats0 = store_stats(store_mesh)
    assert generate(store_mesh, prompts[0])[0] == want[0]             # one node computes the prefix
    wait_stored(store_mesh, 34, since=stats0)
    redis.stop(kill=True)
    try:
        for k in (1, 2):             # one node holds the prefix itself, the other reads it from the store
            tokens, usage = generate(store_mesh, prompts[k])
            assert tokens == want[k]
            assert usage.cached_prompt_tokens == 512
        assert_no_blocks_in_use(store_mesh)
    finally:
        redis.start()
        wait_redis_back(store_mesh)
