"""Prompt logprobs through a real 1 prefill + 1 decode mesh: the gateway validates
sampling.prompt_logprobs, the decode node computes such a prompt itself (the prefill node
pushes nothing for it, the first message says remote = false) and sends them once, in the
first message, equal to the offline engine's; `pdmesh eval --gateway` gives the in-process
perplexity."""
from __future__ import annotations

import asyncio
import json
import random
import time

import grpc
import pytest

from common.engine import LLM, SamplingParams
from protos.pdmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.cli import main as pdmesh
from services.convert import prompt_logprobs_from_proto
from tests.channels import operator_channel
from tests.integration.conftest import ENGINE, engine_stats

PROMPT_LEN, MAX_TOKENS, TOP = 300, 4, 3
IDLE_WAIT_S = 30.0   # hang guard: a finished request's blocks are freed at once, seen at the next stats read


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def mesh(model, start_mesh):
    return start_mesh(model)


def random_prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1024) for _ in range(PROMPT_LEN)]


def request(ids: list[int], **sampling) -> gateway_pb2.GenerateRequest:
    req = gateway_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, **sampling))
    req.prompt_token_ids.ids.extend(ids)
    return req


def generate(address: str, req) -> list[gateway_pb2.GenerateResponse]:
    async def run():
        async with operator_channel(address) as ch:
            return [m async for m in gateway_pb2_grpc.GatewayStub(ch).Generate(req, timeout=120)]
    return asyncio.run(run())


def prefill_bytes(mesh) -> int:
    return engine_stats(mesh.services["prefill-0"].address, "prefill").transfer_bytes_written


def wait_idle(mesh) -> None:
    deadline = time.monotonic() + IDLE_WAIT_S
    for node, role in (("decode-0", "decode"), ("prefill-0", "prefill")):
        while (stats := engine_stats(mesh.services[node].address, role)).used_blocks:
            assert time.monotonic() < deadline, f"{node} still holds {stats.used_blocks} blocks"
            time.sleep(0.1)


def test_prompt_logprobs_come_from_the_decode_node_once_equal_to_offline(mesh, model):
    plain_prompt, scored_prompt = random_prompt(1), random_prompt(2)
    # a plain prompt of the same length is prefilled by the prefill node
    before = prefill_bytes(mesh)
    plain = generate(mesh.gateway_address, request(plain_prompt))
    assert plain[0].prefill_timing.remote and prefill_bytes(mesh) > before
    assert not any(m.prompt_logprobs for m in plain)
    before = prefill_bytes(mesh)
    msgs = generate(mesh.gateway_address, request(scored_prompt, prompt_logprobs=TOP))
    assert not msgs[0].prefill_timing.remote and prefill_bytes(mesh) == before
    assert len(msgs[0].prompt_logprobs) == PROMPT_LEN - 1 and not any(m.prompt_logprobs for m in msgs[1:])
    offline = LLM(str(model), **ENGINE).generate({"prompt_token_ids": scored_prompt},
                                                 SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                                ignore_eos=True, prompt_logprobs=TOP))[0]
    got = prompt_logprobs_from_proto(msgs[0].prompt_logprobs)
    assert [list(e) for e in got[1:]] == [list(e) for e in offline.prompt_logprobs[1:]]   # same ids, same order
    for p in range(1, PROMPT_LEN):
        assert got[p] == pytest.approx(offline.prompt_logprobs[p], abs=1e-5), f"position {p}"
    assert [t for m in msgs for t in m.token_ids] == offline.outputs[0].token_ids
    assert msgs[-1].usage.cached_prompt_tokens == 0
    wait_idle(mesh)


@pytest.mark.parametrize("value", [-1, 21])
def test_out_of_range_prompt_logprobs_are_invalid_argument(mesh, value):
    with pytest.raises(grpc.aio.AioRpcError) as e:
        generate(mesh.gateway_address, request([5, 6, 7], prompt_logprobs=value))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == f"prompt_logprobs must be None or an integer in [0, 20], got {value}"


def test_eval_over_the_gateway_equals_in_process(mesh, model, tmp_path):
    common = ["--text", "gpl-3", "--window", "64", "--stride", "32", "--max-tokens", "300"]
    assert pdmesh(["eval", "--gateway", mesh.gateway_address, "--api-key-file", mesh.environ["PDMESH_API_KEYS_FILE"],
                   *common, "--json", str(tmp_path / "gw.json")]) == 0
    assert pdmesh(["eval", "--model", str(model), *common, "--json", str(tmp_path / "local.json")]) == 0
    gw, local = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("gw", "local"))
    keys = ("scored", "num_windows", "num_tokens", "window", "stride", "text_sha256", "special_ids", "model_id")
    assert {k: gw[k] for k in keys} == {k: local[k] for k in keys}
    assert (gw["scored"], gw["num_windows"]) == (299, 9)   # begins 0, 32, ..., 256
    assert gw["nll"] == pytest.approx(local["nll"], rel=1e-6) and gw["ppl"] == pytest.approx(local["ppl"], rel=1e-6)
    wait_idle(mesh)
