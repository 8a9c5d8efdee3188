"""services/gateway/openai_http/app.py + server.py on a fake servicer (no mesh): the real
`openai` client over uvicorn on this event loop; what reaches the servicer; the key
check; SSE framing; and a client that leaves, streaming or not, closes its replies."""
from __future__ import annotations

import asyncio
import json
import time

import grpc
import openai
import pytest

from common.config import LimitsConfig
from protos.pdmesh.v1 import gateway_pb2
from services.gateway.openai_http.app import create_app
from services.gateway.openai_http.chat_template import ChatTemplate
from services.gateway.openai_http.server import HttpServer
from services.gateway.public_errors import PublicError
from services.gateway.servicer import UnknownModel
from services.security.credentials import MeshCredentials

KEY = "client-key"


class FakePool:
    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]


class FakeServicer:
    """GatewayServicer's surface the HTTP API uses: replies are tokens 0, 1, ... one per
    10 ms, text "t0 t1 ..."; records each request and which replies were closed early."""

    model_id, max_model_len, limits = "tiny", 2048, LimitsConfig()
    tokenizer = None   # token texts are needed for logprobs only (the mesh test has them)

    def __init__(self):
        self.tokenizer_pool = FakePool()
        self.requests: list[gateway_pb2.GenerateRequest] = []
        self.closed_early = 0

    def check_model(self, model: str) -> None:
        if model and model != self.model_id:
            raise UnknownModel(f"model {model!r} is not served here")

    def deadline(self, client_remaining_s=None) -> float:
        return time.monotonic() + 60

    async def open_stream(self, request, deadline):
        if request.model and request.model != self.model_id:
            raise PublicError(grpc.StatusCode.INVALID_ARGUMENT, "model is not served here", "model_not_found")
        if request.sampling.max_tokens < 1:
            raise PublicError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"max_tokens must be an integer >= 1, got {request.sampling.max_tokens}")
        if request.sampling.max_tokens == 999:
            raise PublicError(grpc.StatusCode.RESOURCE_EXHAUSTED, "every decode node is busy now; retry later")
        self.requests.append(request)
        return request

    async def replies(self, request):
        n, done = request.sampling.max_tokens, False
        try:
            for i in range(n):
                await asyncio.sleep(0.01)
                reply = gateway_pb2.GenerateResponse(token_ids=[i], text=f"t{i} ")
                if i == n - 1:
                    reply.finish_reason = "length"
                    reply.usage.prompt_tokens, reply.usage.completion_tokens = 3, n
                    reply.usage.cached_prompt_tokens = 1
                    done = True
                yield reply
        finally:
            if not done:
                self.closed_early += 1


def serve(check):
    """Run check(servicer, base_url) against a served app on a fresh loop."""
    async def main():
        servicer = FakeServicer()
        template = ChatTemplate("{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}|{% endfor %}")
        http = HttpServer(create_app(servicer, MeshCredentials(api_keys=(KEY.encode(),)), template), "127.0.0.1", 0)
        port = await http.start()
        try:
            await check(servicer, f"http://127.0.0.1:{port}/v1", port)
        finally:
            await http.stop(1.0)
    asyncio.run(main())


def client(base_url: str, key: str = KEY) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0)


def test_fields_reach_the_grpc_request():
    async def check(servicer, base_url, port):
        async with client(base_url) as c:
            out = await c.completions.create(model="tiny", prompt=[7, 8], max_tokens=3, temperature=0.5, top_p=0.9,
                                             seed=11, stop=["x"], extra_body={"top_k": 4, "ignore_eos": True,
                                                                              "return_token_ids": True})
            await c.chat.completions.create(model="", messages=[{"role": "user", "content": "hi"}],
                                            max_completion_tokens=2)
            await c.completions.create(model="tiny", prompt=[7], max_tokens=1, logprobs=0)
            await c.chat.completions.create(model="", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=1, logprobs=True, top_logprobs=5)
        req, chat, with_logprobs, chat_top = servicer.requests
        assert not req.sampling.HasField("logprobs") and not chat.sampling.HasField("logprobs")
        assert (with_logprobs.sampling.logprobs, chat_top.sampling.logprobs) == (0, 5)
        assert list(req.prompt_token_ids.ids) == [7, 8] and req.model == "tiny"
        s = req.sampling
        assert (s.max_tokens, round(s.temperature, 4), round(s.top_p, 4), s.top_k, s.seed, list(s.stop), s.ignore_eos) \
            == (3, 0.5, 0.9, 4, 11, ["x"], True)
        assert list(chat.prompt_token_ids.ids) == [ord(c) for c in "user:hi|"] and chat.sampling.max_tokens == 2
        assert chat.sampling.temperature == 1.0 and chat.sampling.top_k == -1
        assert out.choices[0].token_ids == [0, 1, 2] and out.choices[0].text == "t0 t1 t2 "
        assert out.usage.prompt_tokens_details.cached_tokens == 1
    serve(check)


def test_sse_framing_usage_chunk_and_done():
    async def check(servicer, base_url, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        body = json.dumps({"prompt": "ab", "max_tokens": 2, "stream": True,
                           "stream_options": {"include_usage": True}}).encode()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Connection: close\r\nAuthorization: Bearer " + KEY.encode()
                     + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        raw = (await reader.read()).decode()
        writer.close()
        head, _, payload = raw.partition("\r\n\r\n")
        assert "text/event-stream" in head
        events = [line for line in payload.split("\n") if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e[6:]) for e in events[:-1]]
        assert [c["choices"][0]["text"] for c in chunks[:-1]] == ["t0 ", "t1 "]
        assert all(c["usage"] is None for c in chunks[:-1])
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 1}
    serve(check)


def test_errors_before_the_first_token_are_http_errors_also_when_streaming():
    async def check(servicer, base_url, port):
        async with client(base_url) as c:
            with pytest.raises(openai.RateLimitError):
                await c.completions.create(model="tiny", prompt="x", max_tokens=999, stream=True)
            with pytest.raises(openai.BadRequestError) as e:
                await c.completions.create(model="tiny", prompt="x", max_tokens=0, stream=True)
            assert e.value.body["param"] == "max_tokens"
            with pytest.raises(openai.NotFoundError):
                await c.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
        async with client(base_url, "wrong") as c:
            with pytest.raises(openai.AuthenticationError):
                await c.models.list()
        assert servicer.requests == []
    serve(check)


def test_a_client_that_leaves_closes_its_replies():
    async def check(servicer, base_url, port):
        async with client(base_url) as c:
            stream = await c.completions.create(model="tiny", prompt=[1], max_tokens=500, stream=True)
            async for _ in stream:
                break
            await stream.close()
        for _ in range(100):
            if servicer.closed_early == 1:
                break
            await asyncio.sleep(0.01)
        assert servicer.closed_early == 1
        reader, writer = await asyncio.open_connection("127.0.0.1", port)   # not streaming: leaves at once
        body = json.dumps({"prompt": "x", "max_tokens": 500}).encode()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        await writer.drain()
        await asyncio.sleep(0.2)
        writer.close()
        for _ in range(100):
            if servicer.closed_early == 2:
                break
            await asyncio.sleep(0.01)
        assert servicer.closed_early == 2
    serve(check)


def test_batch_prompts_come_back_in_order():
    async def check(servicer, base_url, port):
        async with client(base_url) as c:
            out = await c.completions.create(model="tiny", prompt=["a", "b", "c"], max_tokens=2)
            chunks = [ch async for ch in await c.completions.create(model="tiny", prompt=[[1], [2]], max_tokens=2,
                                                                    stream=True)]
        assert [ch.index for ch in out.choices] == [0, 1, 2] and out.usage.completion_tokens == 6
        assert sorted(ch.choices[0].index for ch in chunks) == [0, 0, 1, 1]
    serve(check)


def test_chat_template_kwargs_may_not_set_what_render_sets():
    async def check(servicer, base_url, port):
        # closed here: an unclosed client's httpx pool is closed by its finalizer on
        # whatever event loop runs when it is collected (another test's, which then sees
        # "Event loop is closed")
        async with client(base_url) as c:
            for name in ("messages", "add_generation_prompt", "bos_token"):
                with pytest.raises(openai.BadRequestError) as e:
                    await c.chat.completions.create(
                        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                        extra_body={"chat_template_kwargs": {name: "x"}})
                error = e.value.body
                assert error["param"] == "chat_template_kwargs" and f"['{name}']" in error["message"]
            assert servicer.requests == []
            out = await c.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                extra_body={"chat_template_kwargs": {"enable_thinking": False}})
            assert out.choices[0].message.content == "t0 t1 "
    serve(check)
