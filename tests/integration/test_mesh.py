"""The mesh serves requests exactly as the offline engine does: 1 prefill + 1 decode over
Mooncake (TCP) or the gRPC transfer backend, a colocated `both` node, and local prefill."""
from __future__ import annotations

import asyncio
import subprocess
import time

import grpc
import pytest

from common import timeline
from common.engine import LLM, SamplingParams
from protos.pdmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.integration.conftest import ENGINE, engine_stats, mixed_prompts
from tests.channels import operator_channel, operator_channel_sync

MAX_TOKENS = [5, 40, 17, 33, 8, 24, 12, 3, 40, 22, 9, 30, 31, 2, 28, 19]
SAME_ID_SEED = 17     # prompts of their own: pd_mesh's decode node holds no prefix of them
LEAK_WAIT_S = 30.0    # only catches blocks never freed: a loaded machine frees them late
PROBE_PROMPT, PROBE_TOKENS = list(range(600, 640)), 200


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama")


def offline_tokens(model, prompts: list[list[int]]) -> list[list[int]]:
    """The offline engine's greedy tokens of each prompt, MAX_TOKENS[i] of the i-th."""
    llm = LLM(str(model), **ENGINE)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in MAX_TOKENS])
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def expected(model):
    return offline_tokens(model, mixed_prompts())


@pytest.fixture(scope="module")
def same_id_expected(model):
    return offline_tokens(model, mixed_prompts(seed=SAME_ID_SEED))


@pytest.fixture(scope="module")
def timelines(tmp_path_factory):
    return tmp_path_factory.mktemp("timelines")


@pytest.fixture(scope="module")
def pd_mesh(model, start_mesh, timelines):
    return start_mesh(model, env={"PDMESH_TIMELINE_DIR": str(timelines)})


def request(ids=None, prompt=None, max_tokens=16, **sampling):
    req = gateway_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(
        max_tokens=max_tokens, ignore_eos=sampling.pop("ignore_eos", True), **sampling))
    if prompt is not None:
        req.prompt = prompt
    else:
        req.prompt_token_ids.ids.extend(ids)
    return req


async def stream(address: str, req) -> tuple[list[int], str, list]:
    async with operator_channel(address) as ch:
        msgs = [m async for m in gateway_pb2_grpc.GatewayStub(ch).Generate(req)]
    tokens = [t for m in msgs for t in m.token_ids]
    return tokens, "".join(m.text for m in msgs), msgs


async def run_concurrently(address: str) -> list:
    reqs = [request(p, max_tokens=m) for p, m in zip(mixed_prompts(), MAX_TOKENS)]
    return await asyncio.gather(*(stream(address, r) for r in reqs))


def assert_matches_offline(results, expected):
    for i, ((tokens, _, msgs), want) in enumerate(zip(results, expected)):
        assert tokens == want, f"request {i}"
        assert all(m.token_ids for m in msgs[:-1]), "every message but the last carries tokens"
        last = msgs[-1]
        assert last.finish_reason == "length"
        assert last.usage.completion_tokens == len(want)
        assert [m.finish_reason for m in msgs[:-1]] == [""] * (len(msgs) - 1)


def assert_no_blocks_in_use(mesh, timeout_s: float = LEAK_WAIT_S):
    """Every engine node ends with no block used or quarantined and no request in flight,
    and the kv-store (when the mesh has one) with no block pinned."""
    deadline = time.monotonic() + timeout_s
    for svc in mesh.services.values():
        if svc.role == "kv-store" and svc.process.poll() is None:
            while (pinned := kv_store_stats(svc.address).blocks_pinned) != 0:
                assert time.monotonic() < deadline, f"the kv-store still pins {pinned} blocks"
                time.sleep(0.05)
        if svc.role not in ("prefill", "decode", "both") or svc.process.poll() is not None:
            continue
        while True:
            try:
                stats = engine_stats(svc.address, svc.role)
            except grpc.RpcError as e:
                # a node whose engine died stops its server first, then exits (serve.py):
                # one on its way out holds nothing to check; any other must answer
                if e.code() != grpc.StatusCode.UNAVAILABLE or not exits(svc.process, deadline):
                    raise
                break
            if (stats.used_blocks, stats.quarantined_blocks, stats.running, stats.waiting,
                    stats.kv_remote, stats.held) == (0, 0, 0, 0, 0, 0):
                break
            assert time.monotonic() < deadline, f"{svc.name} still holds blocks: {stats}"
            time.sleep(0.05)


def assert_left_requests_stopped(mesh, decode: str = "decode-0") -> None:
    """The requests whose clients left (each with far more than PROBE_TOKENS tokens to
    go) were aborted: once a PROBE_TOKENS request sent after they were left has finished,
    decoded in the same batch, nothing else runs or waits on the decode node (a request
    not aborted would still need hundreds of steps); then every block comes back."""
    tokens, _, _ = asyncio.run(stream(mesh.gateway_address, request(PROBE_PROMPT, max_tokens=PROBE_TOKENS)))
    assert len(tokens) == PROBE_TOKENS
    stats = engine_stats(mesh.services[decode].address, "decode")
    assert (stats.running, stats.waiting) == (0, 0), f"a request whose client left still runs: {stats}"
    assert_no_blocks_in_use(mesh)


def exits(process, deadline: float) -> bool:
    """Whether `process` exits by `deadline` (time.monotonic)."""
    try:
        process.wait(max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return False
    return True


def kv_store_stats(address: str):
    from protos.pdmesh.v1 import kv_store_pb2, kv_store_pb2_grpc
    with operator_channel_sync(address) as ch:
        return kv_store_pb2_grpc.KVStoreStub(ch).Stats(kv_store_pb2.StatsRequest(), timeout=5)


def kv_bytes(model_dir, num_tokens: int) -> int:
    """Bytes of KV a push of num_tokens prompt tokens writes (K and V, every layer; the
    partial last block only up to the prompt's end)."""
    from common.model.config import load_model_config
    cfg = load_model_config(str(model_dir))
    return num_tokens * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4   # float32


def assert_ran_remotely(mesh, model_dir, results, prompts, written_before: int) -> None:
    """Every request was prefilled by the prefill node, and its transfer engine wrote
    exactly the prompts' KV into the decode node (no prefix hit there: random prompts)."""
    assert all(msgs[0].prefill_timing.remote for _, _, msgs in results)
    prefill = engine_stats(mesh.services["prefill-0"].address, "prefill")
    assert prefill.transfer_bytes_written - written_before == sum(kv_bytes(model_dir, len(p)) for p in prompts)


def bytes_written(mesh) -> int:
    return engine_stats(mesh.services["prefill-0"].address, "prefill").transfer_bytes_written


def test_disaggregated_mooncake_matches_offline(pd_mesh, model, expected):
    """mixed_prompts() are sent to pd_mesh by this test only: the decode node holds no
    prefix of them, so the prefill node pushes every prompt's whole KV."""
    before, borrowed = bytes_written(pd_mesh), borrowed_steps(pd_mesh)
    results = asyncio.run(run_concurrently(pd_mesh.gateway_address))
    assert_matches_offline(results, expected)
    assert_ran_remotely(pd_mesh, model, results, mixed_prompts(), before)
    prefill = engine_stats(pd_mesh.services["prefill-0"].address, "prefill")
    assert prefill.prefix_hit_tokens >= 0 and prefill.total_blocks == ENGINE["num_blocks"]
    assert_borrowed_the_prefill_cores(pd_mesh, borrowed)
    assert_no_blocks_in_use(pd_mesh)


def borrowed_steps(mesh) -> int:
    return engine_stats(mesh.services["decode-0"].address, "decode").borrowed_core_steps


def assert_borrowed_the_prefill_cores(mesh, borrowed_before: int) -> None:
    """Where the launcher lent the decode node the prefill node's core (2 cores or more),
    the decode node ran steps there (the burst's decode-only tail) since borrowed_before
    (borrowed_steps before the burst)."""
    decode, prefill = mesh.services["decode-0"], mesh.services["prefill-0"]
    if not decode.cpu.borrows:
        return
    assert decode.cpu.borrows == prefill.cpu.cores
    assert borrowed_steps(mesh) > borrowed_before


@pytest.mark.parametrize("variant", ["grpc-transfer", "both-node", "local-prefill"])
def test_other_topologies_match_offline(variant, model, start_mesh, expected):
    if variant == "grpc-transfer":
        mesh = start_mesh(model, transfer="grpc")
    elif variant == "both-node":
        mesh = start_mesh(model, nodes=[("both", "both-0")])
    else:
        mesh = start_mesh(model, local_prefill_max_tokens=10**6)
    try:
        before = bytes_written(mesh) if variant != "both-node" else 0
        borrowed = borrowed_steps(mesh) if variant == "local-prefill" else 0
        results = asyncio.run(run_concurrently(mesh.gateway_address))
        assert_matches_offline(results, expected)
        assert_no_blocks_in_use(mesh)
        if variant == "grpc-transfer":
            assert_ran_remotely(mesh, model, results, mixed_prompts(), before)
        elif variant == "local-prefill":
            assert not any(msgs[0].prefill_timing.remote for _, _, msgs in results)
            assert bytes_written(mesh) == before
            assert_borrowed_the_prefill_cores(mesh, borrowed)
    finally:
        mesh.stop()


def test_stop_strings_cut_exactly(pd_mesh):
    prompt = "The river ran slowly past the old mill"
    tokens, text, msgs = asyncio.run(stream(pd_mesh.gateway_address, request(prompt=prompt, max_tokens=30)))
    assert msgs[-1].finish_reason == "length" and len(tokens) == 30
    stop = next(text[i:i + 3] for i in range(len(text) // 3, len(text) - 3)
                if text[i:i + 3].strip() and "\ufffd" not in text[i:i + 3])
    cut_tokens, cut_text, cut_msgs = asyncio.run(stream(
        pd_mesh.gateway_address, request(prompt=prompt, max_tokens=30, stop=[stop])))
    assert cut_text == text[:text.index(stop)]
    assert cut_msgs[-1].finish_reason == "stop"
    assert cut_tokens == tokens[:len(cut_tokens)]
    assert_no_blocks_in_use(pd_mesh)


def test_cancel_mid_stream_frees_every_block(pd_mesh):
    async def cancel_after(n):
        async with operator_channel(pd_mesh.gateway_address) as ch:
            call = gateway_pb2_grpc.GatewayStub(ch).Generate(request(list(range(5, 300)), max_tokens=1500))
            got = 0
            async for m in call:
                got += len(m.token_ids)
                if got >= n:
                    call.cancel()
                    break
            return got

    async def many():
        return await asyncio.gather(*(cancel_after(n) for n in (1, 3, 10, 25)))

    assert min(asyncio.run(many())) >= 1
    assert_left_requests_stopped(pd_mesh)


@pytest.mark.parametrize("req,field", [
    (request(prompt=""), "prompt must not be empty"),
    (request([5] * 2040, max_tokens=20), "max_model_len"),
    (request([5, 6], max_tokens=0), "max_tokens"),
    (request([5, 6], top_p=1.5), "top_p"),
    (request([5, 6], top_k=-3), "top_k"),
    (request([5, 6000]), "vocabulary"),
])
def test_bad_requests_are_invalid_argument(pd_mesh, req, field):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        asyncio.run(stream(pd_mesh.gateway_address, req))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()
    tokens, _, _ = asyncio.run(stream(pd_mesh.gateway_address, request([5, 6, 7], max_tokens=3)))
    assert len(tokens) == 3


def test_unknown_model_is_invalid_argument(pd_mesh):
    req = request([5, 6])
    req.model = "no-such-model"
    with pytest.raises(grpc.aio.AioRpcError) as err:
        asyncio.run(stream(pd_mesh.gateway_address, req))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "no-such-model" in err.value.details()


def test_tokenize_and_list_models(pd_mesh, model):
    from common.model.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(model)

    async def calls():
        async with operator_channel(pd_mesh.gateway_address) as ch:
            stub = gateway_pb2_grpc.GatewayStub(ch)
            t = await stub.Tokenize(gateway_pb2.TokenizeRequest(text="hello world", add_special_tokens=True))
            m = await stub.ListModels(gateway_pb2.ListModelsRequest())
            return list(t.token_ids), m

    ids, models = asyncio.run(calls())
    assert ids == tok.encode("hello world")
    assert [m.id for m in models.models] == [model.name]


def test_every_service_has_health_and_reflection(pd_mesh):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase)
    expected = {"meta-server": "pdmesh.v1.MetaServer", "prefill": "pdmesh.v1.Prefill",
                "decode": "pdmesh.v1.Decode", "gateway": "pdmesh.v1.Gateway"}
    for svc in pd_mesh.services.values():
        with operator_channel_sync(svc.address) as ch:
            status = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=expected[svc.role]), timeout=5).status
            assert status == health_pb2.HealthCheckResponse.SERVING
            services = set(ProtoReflectionDescriptorDatabase(ch).get_services())
            assert {expected[svc.role], "grpc.health.v1.Health"} <= services, svc.name


def test_clients_may_send_the_same_request_id_at_once(pd_mesh, same_id_expected):
    """The mesh keys each attempt by its own id: two clients' equal ids never meet."""
    prompts = mixed_prompts(seed=SAME_ID_SEED)

    async def rounds():
        results = []
        for i in range(8):
            pair = [request(prompts[j], max_tokens=MAX_TOKENS[j]) for j in (2 * i, 2 * i + 1)]
            for req in pair:
                req.request_id = "same-id"
            results += await asyncio.gather(*(stream(pd_mesh.gateway_address, r) for r in pair))
        return results

    assert_matches_offline(asyncio.run(rounds()), same_id_expected)
    assert_no_blocks_in_use(pd_mesh)


def test_a_remote_prefill_leaves_one_ordered_timeline(pd_mesh, timelines):
    """common/timeline.py, as bench/handoff.py reads it: every service marks its events of
    a request, under its own id, and the gateway's links join them into one timeline in
    the order the request met them."""
    req = request(list(range(3, 40)), max_tokens=4)
    req.request_id = "timeline-probe"
    tokens, _, msgs = asyncio.run(stream(pd_mesh.gateway_address, req))
    assert len(tokens) == 4 and msgs[0].prefill_timing.remote
    events = timeline.read(timelines)["timeline-probe"]
    served = [e for e in timeline.EVENTS if not e.startswith("client.")]
    assert sorted(events) == sorted(served)
    assert sorted(served, key=events.get) == served, "in the order the request met them"
