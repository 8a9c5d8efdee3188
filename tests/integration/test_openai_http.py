"""The gateway's OpenAI-compatible HTTP API against a real mesh (1 prefill + 1 decode,
Mooncake over TCP), with the real `openai` client (sync and async, streaming and not),
raw HTTP for exact error bodies, and `curl -N`: the same tokens as the gRPC API and the
offline engine, OpenAI's error shape with the field named, and no KV block left in use."""
from __future__ import annotations

import asyncio
import json
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request

import openai
import pytest

from common.engine import LLM, SamplingParams
from common.model.tokenizer import Tokenizer
from services.gateway.openai_http.chat_template import ChatTemplate
from services.node.grpc_util import free_port
from tests.integration.conftest import ENGINE, engine_stats, mixed_prompts
from tests.integration.test_mesh import assert_left_requests_stopped, assert_no_blocks_in_use, request, stream

PROMPTS = mixed_prompts(3, seed=11)
MAX_TOKENS = [12, 7, 20]
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}]
HANG_GUARD_S = 60.0   # only catches a hang: a loaded machine may take many seconds


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def mesh(model, start_mesh):
    return start_mesh(model, top={"gateway": {"port": 0, "http_port": free_port()}})


@pytest.fixture(scope="module")
def base_url(mesh):
    assert mesh.http_address
    return mesh.http_address + "/v1"


@pytest.fixture(scope="module")
def key(mesh):
    k = mesh.api_key()
    assert k, "the launcher gives the gateway API keys"
    return k


@pytest.fixture(scope="module")
def client(base_url, key):
    with openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def model_id(mesh):
    return mesh.mesh.resolved_model_id


@pytest.fixture(scope="module")
def expected(model):
    llm = LLM(str(model), **ENGINE)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in MAX_TOKENS])
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def chat_ids(model):
    text = ChatTemplate.from_dir(model).render(CHAT, add_generation_prompt=True)
    return Tokenizer.from_dir(model).encode(text, add_special_tokens=False)


@pytest.fixture(autouse=True)
def _no_blocks_left(mesh):
    yield
    assert_no_blocks_in_use(mesh)


def grpc_tokens(mesh, ids, max_tokens, **sampling) -> tuple[list[int], str]:
    tokens, text, _ = asyncio.run(stream(mesh.gateway_address, request(ids, max_tokens=max_tokens, **sampling)))
    return tokens, text


def post(base_url: str, path: str, body, key: str | None) -> tuple[int, dict]:
    """(status, JSON body) of a raw POST."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(base_url + path, data, headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def test_models_lists_the_mesh_model(client, model_id):
    assert [m.id for m in client.models.list().data] == [model_id]
    assert client.models.retrieve(model_id).id == model_id


def test_completion_tokens_equal_grpc_and_offline(mesh, client, model_id, expected):
    for ids, max_tokens, want in zip(PROMPTS, MAX_TOKENS, expected):
        out = client.completions.create(model=model_id, prompt=ids, max_tokens=max_tokens, temperature=0,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
        [choice] = out.choices
        tokens, text = grpc_tokens(mesh, ids, max_tokens)
        assert choice.token_ids == tokens == want
        assert choice.text == text and choice.finish_reason == "length"
        assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), max_tokens)
        assert out.usage.total_tokens == len(ids) + max_tokens
        assert out.usage.prompt_tokens_details.cached_tokens >= 0


def test_batch_of_prompts_and_seeded_sampling_equal_grpc(mesh, client, model_id, expected):
    out = client.completions.create(model=model_id, prompt=PROMPTS[:2], max_tokens=MAX_TOKENS[0], temperature=0,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.token_ids for c in out.choices] == [grpc_tokens(mesh, p, MAX_TOKENS[0])[0] for p in PROMPTS[:2]]
    assert out.choices[0].token_ids == expected[0]
    assert out.choices[1].token_ids[:MAX_TOKENS[1]] == expected[1]   # greedy: a prefix of the longer run
    assert out.usage.completion_tokens == 2 * MAX_TOKENS[0]
    seeded = client.completions.create(model=model_id, prompt=PROMPTS[2], max_tokens=16, temperature=0.9,
                                       top_p=0.95, seed=1234,
                                       extra_body={"top_k": 50, "ignore_eos": True, "return_token_ids": True})
    tokens, text = grpc_tokens(mesh, PROMPTS[2], 16, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    assert seeded.choices[0].token_ids == tokens and seeded.choices[0].text == text


def test_stop_strings_cut_as_on_grpc(mesh, client, model_id):
    full_tokens, full_text = grpc_tokens(mesh, PROMPTS[0], 30)
    stop = next(full_text[i:i + 3] for i in range(len(full_text) // 2, len(full_text) - 3)
                if not any(c.isspace() for c in full_text[i:i + 3]))
    out = client.completions.create(model=model_id, prompt=PROMPTS[0], max_tokens=30, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    _, text = grpc_tokens(mesh, PROMPTS[0], 30, stop=[stop])
    assert out.choices[0].text == text == full_text[:full_text.index(stop)]
    assert out.choices[0].finish_reason == "stop"


def test_async_streaming_completion_ends_with_usage(base_url, key, model_id, expected):
    async def run():
        async with openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0) as c:
            whole = await c.completions.create(model=model_id, prompt=PROMPTS[1], max_tokens=MAX_TOKENS[1],
                                               temperature=0, extra_body={"ignore_eos": True})
            chunks = [ch async for ch in await c.completions.create(
                model=model_id, prompt=PROMPTS[1], max_tokens=MAX_TOKENS[1], temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True, "return_token_ids": True})]
            return whole, chunks

    whole, chunks = asyncio.run(run())
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == MAX_TOKENS[1]
    assert last.usage.prompt_tokens == len(PROMPTS[1])
    assert last.usage.prompt_tokens_details.cached_tokens >= 0
    assert all(ch.usage is None for ch in body)
    assert "".join(ch.choices[0].text for ch in body) == whole.choices[0].text
    assert [t for ch in body for t in ch.choices[0].token_ids] == expected[1]
    assert [ch.choices[0].finish_reason for ch in body][-1] == "length"


def test_chat_equals_grpc_on_the_templated_prompt(mesh, client, base_url, key, model_id, chat_ids):
    tokens, text = grpc_tokens(mesh, chat_ids, 24)
    out = client.chat.completions.create(model=model_id, messages=CHAT, max_completion_tokens=24, temperature=0,
                                         extra_body={"ignore_eos": True, "return_token_ids": True})
    [choice] = out.choices
    assert choice.message.role == "assistant" and choice.message.content == text
    assert choice.token_ids == tokens and choice.finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(chat_ids), 24)

    async def streamed():
        async with openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0) as c:
            return [ch async for ch in await c.chat.completions.create(
                model=model_id, messages=CHAT, max_tokens=24, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})]

    chunks = asyncio.run(streamed())
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    sync_chunks = list(client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=24, temperature=0,
                                                      stream=True, extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].delta.content or "" for ch in sync_chunks) == text


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl not installed")
def test_curl_streams_server_sent_events_ending_with_done(base_url, key, model_id):
    body = {"model": model_id, "prompt": PROMPTS[0], "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    out = subprocess.run(["curl", "-N", "-sS", "--fail-with-body", f"{base_url}/completions",
                          "-H", "Content-Type: application/json", "-H", f"Authorization: Bearer {key}",
                          "-d", json.dumps(body)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr + out.stdout
    events = [e for e in out.stdout.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    usage = json.loads(events[-2].removeprefix("data: "))
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5
    assert set(usage["usage"]["prompt_tokens_details"]) == {"cached_tokens"}


NUM_TOP = 3
LOGPROB_TOL = 2e-4   # the mesh's batches are not the offline engine's: float32 sums differ in order


@pytest.fixture(scope="module")
def offline_logprobs(model):
    """The offline engine's tokens and logprobs (the sampled token and the top NUM_TOP)
    of PROMPTS[0]."""
    llm = LLM(str(model), **ENGINE)
    out = llm.generate([{"prompt_token_ids": PROMPTS[0]}],
                       [SamplingParams(max_tokens=MAX_TOKENS[0], temperature=0.0, ignore_eos=True,
                                       logprobs=NUM_TOP)])[0].outputs[0]
    return out.token_ids, out.logprobs


def _near(got: dict[int, float], want: dict[int, float]) -> None:
    assert set(got) == set(want)
    for t in want:
        assert abs(got[t] - want[t]) <= LOGPROB_TOL, (t, got[t], want[t])


def test_grpc_logprobs_come_through_the_remote_prefill(mesh, offline_logprobs):
    """The first token's logprobs were computed by the prefill node (prefill_timing.remote):
    they travel prefill -> decode -> gateway; the rest come from the decode node."""
    want_tokens, want = offline_logprobs
    tokens, _, msgs = asyncio.run(stream(mesh.gateway_address, request(PROMPTS[0], max_tokens=MAX_TOKENS[0],
                                                                       logprobs=NUM_TOP)))
    assert msgs[0].prefill_timing.remote, "the prompt was prefilled on the prefill node"
    entries = [e for m in msgs for e in m.logprobs]
    assert tokens == want_tokens and len(entries) == len(tokens)
    for tok, entry, w in zip(tokens, entries, want):
        assert entry.token_ids[0] == tok
        _near(dict(zip(entry.token_ids, entry.logprobs)), w)
    plain = asyncio.run(stream(mesh.gateway_address, request(PROMPTS[0], max_tokens=MAX_TOKENS[0])))[2]
    assert not any(m.logprobs for m in plain), "no logprobs unless asked for"


def test_completion_logprobs_in_openai_shape(client, model_id, model, offline_logprobs):
    want_tokens, want = offline_logprobs
    tok = Tokenizer.from_dir(model)
    out = client.completions.create(model=model_id, prompt=PROMPTS[0], max_tokens=MAX_TOKENS[0], temperature=0,
                                    logprobs=NUM_TOP, extra_body={"ignore_eos": True, "return_token_ids": True})
    [choice] = out.choices
    lp = choice.logprobs
    assert choice.token_ids == want_tokens
    assert lp.tokens == [tok.decode([t], skip_special_tokens=False) for t in want_tokens]
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for t, got, top, w in zip(want_tokens, lp.token_logprobs, lp.top_logprobs, want):
        assert abs(got - w[t]) <= LOGPROB_TOL
        best = sorted(w.items(), key=lambda p: -p[1])[:NUM_TOP]
        assert list(top) == [tok.decode([i], skip_special_tokens=False) for i, _ in best]
    chunks = list(client.completions.create(model=model_id, prompt=PROMPTS[0], max_tokens=MAX_TOKENS[0],
                                            temperature=0, logprobs=NUM_TOP, stream=True,
                                            extra_body={"ignore_eos": True}))
    streamed = [(t, o) for ch in chunks for t, o in zip(ch.choices[0].logprobs.tokens,
                                                        ch.choices[0].logprobs.text_offset)]
    assert streamed == list(zip(lp.tokens, lp.text_offset)), "offsets continue across chunks"


def test_chat_logprobs_equal_grpc(mesh, client, base_url, key, model_id, chat_ids, model):
    tokens, _, msgs = asyncio.run(stream(mesh.gateway_address, request(chat_ids, max_tokens=10, logprobs=2)))
    entries = [e for m in msgs for e in m.logprobs]
    tok = Tokenizer.from_dir(model)
    out = client.chat.completions.create(model=model_id, messages=CHAT, max_completion_tokens=10, temperature=0,
                                         logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert [c.token for c in content] == [tok.decode([t], skip_special_tokens=False) for t in tokens]
    for c, t, e in zip(content, tokens, entries):
        assert abs(c.logprob - e.logprobs[0]) <= LOGPROB_TOL
        assert c.bytes == list(tok.token_bytes(t)) if tok.is_byte_level else list(c.token.encode())
        best = sorted(zip(e.token_ids, e.logprobs), key=lambda p: -p[1])[:2]
        assert [x.token for x in c.top_logprobs] == [tok.decode([i], skip_special_tokens=False) for i, _ in best]
    chunks = list(client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=10, temperature=0,
                                                 logprobs=True, stream=True, extra_body={"ignore_eos": True}))
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs
                for c in ch.choices[0].logprobs.content]
    assert [c.token for c in streamed] == [c.token for c in content]
    assert all(c.top_logprobs == [] for c in streamed), "top_logprobs unset: none"
    plain = client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=3, temperature=0)
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize("path,body,param", [
    ("/completions", {"prompt": [5, 6], "max_tokens": 0}, "max_tokens"),
    ("/completions", {"prompt": [5, 6], "max_tokens": 5000}, "max_tokens"),
    ("/completions", {"prompt": [5, 6], "temperature": -1}, "temperature"),
    ("/completions", {"prompt": [5, 6], "temperature": "hot"}, "temperature"),
    ("/completions", {"prompt": [5, 6], "top_p": 1.5}, "top_p"),
    ("/completions", {"prompt": [5, 999999]}, "prompt"),
    ("/completions", {"prompt": []}, "prompt"),
    ("/completions", {"prompt": [5, 6], "n": 2}, "n"),
    ("/completions", {"prompt": [5, 6], "logprobs": 21}, "logprobs"),
    ("/completions", {"prompt": [5, 6], "logprobs": -1}, "logprobs"),
    ("/completions", {"prompt": [5, 6], "stop": ["x" * 1000]}, "stop"),
    ("/completions", {}, "prompt"),
    ("/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, "messages"),
    ("/chat/completions", {"messages": []}, "messages"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 4000},
     "max_completion_tokens"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4000}, "max_tokens"),
    ("/completions", b"{not json", None),
])
def test_bad_requests_are_400_naming_the_field(base_url, key, path, body, param):
    status, answer = post(base_url, path, body, key)
    assert status == 400, answer
    assert set(answer) == {"error"} and set(answer["error"]) == {"message", "type", "param", "code"}
    assert answer["error"]["type"] == "invalid_request_error"
    assert answer["error"]["param"] == param, answer


def test_unknown_model_is_404_and_no_key_is_401(base_url, key, client):
    status, answer = post(base_url, "/completions", {"model": "gpt-4", "prompt": "hi"}, key)
    assert status == 404 and answer["error"]["code"] == "model_not_found" and answer["error"]["param"] == "model"
    status, answer = post(base_url, "/chat/completions", {"model": "gpt-4", "messages": CHAT}, key)
    assert status == 404 and answer["error"]["code"] == "model_not_found"
    for sent in (None, "not-a-key"):
        status, answer = post(base_url, "/completions", {"prompt": "hi"}, sent)
        assert status == 401 and answer["error"]["code"] == "invalid_api_key", answer
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="hi")
    with openai.OpenAI(base_url=base_url, api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="", prompt=[5, 6], max_tokens=0)
    assert "max_tokens" in str(e.value)


def test_errors_name_no_internal_address(mesh, base_url, key):
    status, answer = post(base_url, "/completions", {"prompt": [5, 999999]}, key)
    text = json.dumps(answer)
    for svc in mesh.services.values():
        assert svc.address not in text and svc.name not in text


def _running(mesh) -> int:
    return engine_stats(mesh.services["decode-0"].address, "decode").running


def _wait_running(mesh, timeout_s: float = HANG_GUARD_S) -> None:
    deadline = time.monotonic() + timeout_s
    while _running(mesh) == 0:
        assert time.monotonic() < deadline, "the request never ran"
        time.sleep(0.02)


def test_client_leaving_mid_stream_cancels_its_request(mesh, base_url, key, model_id):
    async def leave_after(n: int) -> int:
        async with openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0) as c:
            s = await c.completions.create(model=model_id, prompt=PROMPTS[0], max_tokens=1500, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
            got = 0
            async for _ in s:
                got += 1
                if got == n:
                    break
            await s.close()
            return got

    assert asyncio.run(leave_after(3)) == 3
    assert_left_requests_stopped(mesh)


def test_client_leaving_before_the_answer_cancels_its_request(mesh, base_url, key):
    host, _, port = base_url.removeprefix("http://").removesuffix("/v1").rpartition(":")
    body = json.dumps({"prompt": PROMPTS[0], "max_tokens": 1500, "temperature": 0, "ignore_eos": True}).encode()
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Authorization: Bearer {key}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        _wait_running(mesh)
    assert_left_requests_stopped(mesh)
