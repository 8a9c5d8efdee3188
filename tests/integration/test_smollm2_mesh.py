"""SmolLM2-135M-Instruct through real meshes: a 1P+1D mesh (Mooncake over TCP) and a
colocated `both` node answer chat prompts with exactly the offline engine's tokens, over
gRPC (the rendered chat as text, tokenized by the gateway) and over HTTP with the
`openai` client (chat completions, the gateway's own chat template), stopping at the
model's end of turn as the offline engine does. On the 1P+1D mesh every prompt was
prefilled by the prefill node (its first message says so, and its transfer engine
pushed the KV); no block stays in use."""
from __future__ import annotations

import asyncio

import openai
import pytest

from common.engine import SamplingParams
from protos.pdmesh.v1 import common_pb2, gateway_pb2
from services.gateway.openai_http.chat_template import ChatTemplate
from services.node.grpc_util import free_port
from tests.chat_prompts import CHATS
from tests.integration.test_mesh import assert_no_blocks_in_use, bytes_written, stream

ENGINE = {"num_blocks": 256, "max_num_seqs": 16, "max_model_len": 2048}
MAX_TOKENS = 48       # most answers end at <|im_end|> before this; the others at length
TOPOLOGIES = {"1p1d": (("prefill", "prefill-0"), ("decode", "decode-0")), "colocated": (("both", "both-0"),)}


@pytest.fixture(scope="module")
def prompts(smollm2_dir) -> list[str]:
    template = ChatTemplate.from_dir(smollm2_dir)
    return [template.render(chat) for chat in CHATS]


@pytest.fixture(scope="module")
def expected(smollm2_dir, prompts, llm_factory):
    """(token ids, finish reason) per chat, from the offline engine."""
    outs = llm_factory(smollm2_dir, **ENGINE).generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]


@pytest.fixture(scope="module", params=list(TOPOLOGIES))
def mesh(request, smollm2_dir, start_mesh):
    mesh = start_mesh(smollm2_dir, nodes=TOPOLOGIES[request.param],
                      top={"engine": dict(ENGINE), "gateway": {"port": 0, "http_port": free_port()}})
    yield mesh
    mesh.stop()


@pytest.fixture(autouse=True)
def _no_blocks_left(mesh):
    yield
    assert_no_blocks_in_use(mesh)


def chat_request(prompt: str) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(prompt=prompt, sampling=common_pb2.SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, top_p=1.0, top_k=-1))


def test_grpc_answers_equal_offline(mesh, prompts, expected):
    disaggregated = "prefill-0" in mesh.services
    before = bytes_written(mesh) if disaggregated else 0

    async def all_at_once():
        return await asyncio.gather(*(stream(mesh.gateway_address, chat_request(p)) for p in prompts))

    results = asyncio.run(all_at_once())
    for i, ((tokens, _, msgs), (want, reason)) in enumerate(zip(results, expected)):
        assert tokens == want, f"chat {i}: {CHATS[i][-1]['content']!r}"
        assert msgs[-1].finish_reason == reason
        assert msgs[0].prefill_timing.remote == disaggregated
    assert {reason for _, reason in expected} >= {"stop"}, "some answers end at the model's end of turn"
    if disaggregated:
        assert bytes_written(mesh) > before


def test_http_chat_equals_offline(mesh, expected):
    model_id = mesh.mesh.resolved_model_id
    with openai.OpenAI(base_url=mesh.http_address + "/v1", api_key=mesh.api_key(), max_retries=0,
                       timeout=120) as client:
        for i, (chat, (want, reason)) in enumerate(zip(CHATS, expected)):
            out = client.chat.completions.create(model=model_id, messages=chat, max_tokens=MAX_TOKENS,
                                                 temperature=0, extra_body={"return_token_ids": True})
            [choice] = out.choices
            assert choice.token_ids == want, f"chat {i}"
            assert choice.finish_reason == reason and out.usage.completion_tokens == len(want)
    assert "Paris" in client_text(mesh, model_id, CHATS[0])


def client_text(mesh, model_id: str, chat) -> str:
    with openai.OpenAI(base_url=mesh.http_address + "/v1", api_key=mesh.api_key(), max_retries=0,
                       timeout=120) as client:
        return client.chat.completions.create(model=model_id, messages=chat, max_tokens=MAX_TOKENS,
                                              temperature=0).choices[0].message.content
