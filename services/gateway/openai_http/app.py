"""The OpenAI-compatible routes, over the gRPC path's own pipeline.

    GET  /v1/models, /v1/models/{id}
    POST /v1/completions       prompt: a string, a list of token ids, or a list of either
                               (a batch: one choice per prompt, `index` = its position)
    POST /v1/chat/completions  messages rendered by the model's chat template
                               (chat_template.py), tokenized without special tokens

One request, in order: the API key (before the body is parsed; `Authorization: Bearer
KEY`, the gRPC path's keys and rule) -> the body's types (pydantic; 400 naming the field)
-> fields the mesh cannot serve (400 naming the field) -> chat: model, template, tokens
-> one pdmesh.v1.GenerateRequest per prompt -> GatewayServicer.open_stream (the gRPC
path's bounds, model, sampling and length checks; 400/404/429) -> GatewayServicer.replies
(routing, migration, detokenization, stop strings). Errors before the first token are
HTTP errors (errors.py), also for `stream: true` (streaming.py: server-sent events, and
what a client that leaves cancels).
"""
from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from common.engine.sampling_params import MAX_LOGPROBS
from protos.pdmesh.v1 import common_pb2, gateway_pb2
from services.gateway import public_errors
from services.gateway.openai_http import schemas, streaming
from services.gateway.openai_http.chat_template import ChatTemplate, TemplateError
from services.gateway.openai_http.errors import CHAT_RENAMES, OpenAIError, bad_request, from_public, unauthenticated
from services.gateway.openai_http.logprobs import ChatLogprobs, CompletionLogprobs, TokenTexts
from services.gateway.openai_http.schemas import ChatChunks, CompletionChunks
from services.gateway.openai_http.streaming import ClientGone, collect, merged, until_disconnected
from services.gateway.public_errors import PublicError
from services.gateway.request_limits import bytes_over_limit
from services.gateway.servicer import UnknownModel
from services.gateway.tokenizer_pool import TokenizerBusy
from services.security.server_auth import bearer_token, public_caller_allowed

log = logging.getLogger("pdmesh.gateway")
MAX_PROMPTS = 256            # prompts in one /v1/completions batch
DEFAULT_MAX_TOKENS = 16      # /v1/completions, as OpenAI's; chat: what the context leaves
INT32_MAX = 2**31 - 1


def create_app(servicer, credentials, chat_template: ChatTemplate | None) -> FastAPI:
    """servicer: the gateway's GatewayServicer; credentials: its MeshCredentials (the
    API keys); chat_template: the model's, or None (the chat endpoint then answers 400)."""
    app = FastAPI(title="pdmesh", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(_APIKeyCheck, credentials=credentials)
    created = int(time.time())
    api = _Routes(servicer, chat_template, TokenTexts(servicer.tokenizer))

    @app.exception_handler(RequestValidationError)
    async def _invalid_body(request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        if str(first.get("type", "")).startswith("json"):
            return bad_request("the request body is not valid JSON", None).response()
        loc = [p for p in first.get("loc", ()) if p != "body"]
        param = str(loc[0]) if loc else None   # the top-level field
        where = ".".join(str(p) for p in loc) or "body"
        return bad_request(f"{where}: {first.get('msg', 'invalid request body')}", param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        return OpenAIError(exc.status_code, str(exc.detail), error_type="invalid_request_error").response()

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [schemas.model_card(servicer.model_id, servicer.max_model_len, created)]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        if model_id != servicer.model_id:
            return OpenAIError(404, f"model {public_errors.echo(model_id)} is not served here",
                               "model", "model_not_found").response()
        return schemas.model_card(servicer.model_id, servicer.max_model_len, created)

    @app.post("/v1/completions")
    async def completions(body: schemas.CompletionRequest, request: Request):
        return await _answered(api.completions(body, request), "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(body: schemas.ChatCompletionRequest, request: Request):
        return await _answered(api.chat(body, request), "/v1/chat/completions", CHAT_RENAMES)

    return app


async def _answered(work, what: str, renames: dict[str, str] | None = None) -> Response:
    """work's response, or the error's in OpenAI's shape."""
    try:
        return await work
    except OpenAIError as e:
        return e.response()
    except PublicError as e:
        return from_public(e, renames).response()
    except ClientGone:
        return Response(status_code=499)
    except Exception:
        return from_public(public_errors.internal_error(what)).response()


class _APIKeyCheck:
    """ASGI middleware: /v1/* needs a client API key (the gRPC path's rule:
    services/security/server_auth.public_caller_allowed), checked before the body is read."""

    def __init__(self, app, credentials):
        self.app, self.credentials = app, credentials

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            authorization = next((v for k, v in scope["headers"] if k == b"authorization"), None)
            if not public_caller_allowed(self.credentials, bearer_token(authorization)):
                await unauthenticated().response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _Routes:
    def __init__(self, servicer, chat_template: ChatTemplate | None, texts: TokenTexts):
        self.servicer, self.chat_template, self.texts = servicer, chat_template, texts

    # ---- /v1/completions ---------------------------------------------------------------
    async def completions(self, body: schemas.CompletionRequest, request: Request) -> Response:
        _refuse_unsupported(body)
        prompts = _prompts(body.prompt)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        sampling = _sampling(body, body.max_tokens if body.max_tokens is not None else DEFAULT_MAX_TOKENS)
        reqs = [_generate_request(request_id if len(prompts) == 1 else f"{request_id}-{i}", body.model,
                                  p, sampling) for i, p in enumerate(prompts)]
        streams = await self._open(reqs, request)
        model = body.model or self.servicer.model_id
        if body.stream:
            return await streaming.sse(request, self._replies(streams),
                                       CompletionChunks(request_id, model, body, self.texts))
        results = await until_disconnected(request, collect(self._replies(streams), len(reqs)))
        total = [0, 0, 0]
        choices = []
        for i, (text, ids, finish, usage, logprobs) in enumerate(results):
            schemas.add_usage(total, usage)
            lp = None if body.num_logprobs is None else CompletionLogprobs(self.texts, body.num_logprobs).of(logprobs)
            choices.append(schemas.completion_choice(i, text, finish, ids if body.return_token_ids else None, lp))
        return JSONResponse({**schemas.envelope(request_id, "text_completion", model, choices),
                             "usage": schemas.usage(*total)})

    # ---- /v1/chat/completions ----------------------------------------------------------
    async def chat(self, body: schemas.ChatCompletionRequest, request: Request) -> Response:
        _refuse_unsupported(body)
        servicer = self.servicer
        try:
            servicer.check_model(body.model)
        except ValueError as e:
            raise servicer_error(e) from None
        if self.chat_template is None:
            raise bad_request("this model has no chat template (tokenizer_config.json chat_template); "
                              "use /v1/completions", "messages")
        messages = [_message(m, i) for i, m in enumerate(body.messages)]
        limit = servicer.limits.max_prompt_bytes
        size = sum(len(json.dumps(m, ensure_ascii=False).encode("utf-8")) for m in messages)
        if size > limit:
            raise bad_request(bytes_over_limit("messages", size, "max_prompt_bytes", limit), "messages")
        extra = dict(body.chat_template_kwargs or {})
        reserved = sorted(set(extra) & self.chat_template.reserved_names)
        if reserved:
            raise bad_request(f"chat_template_kwargs may not set {reserved}: the request's own fields "
                              "and the model's special tokens set those", "chat_template_kwargs")
        try:
            text = self.chat_template.render(messages, body.add_generation_prompt, **extra)
        except TemplateError as e:
            raise bad_request(str(e), "messages") from None
        try:
            ids = await servicer.tokenizer_pool.encode(text, add_special_tokens=False)
        except TokenizerBusy as e:
            raise OpenAIError(429, str(e)) from None
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if max_tokens is None:
            max_tokens = max(servicer.max_model_len - len(ids), 1)   # too long: the length check says so
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        named = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        req = _generate_request(request_id, body.model, ids, _sampling(body, max_tokens, named))
        renames = CHAT_RENAMES | {"max_tokens": named}
        streams = await self._open([req], request, renames)
        model = body.model or servicer.model_id
        if body.stream:
            return await streaming.sse(request, self._replies(streams), ChatChunks(request_id, model, body, self.texts))
        [(text, token_ids, finish, usage, logprobs)] = await until_disconnected(
            request, collect(self._replies(streams), 1))
        lp = None if body.num_logprobs is None else ChatLogprobs(self.texts, body.num_logprobs).of(logprobs)
        choice = schemas.chat_choice(0, text, finish, token_ids if body.return_token_ids else None, lp)
        return JSONResponse({**schemas.envelope(request_id, "chat.completion", model, [choice]),
                             "usage": schemas.usage(usage.prompt_tokens, usage.completion_tokens,
                                                    usage.cached_prompt_tokens)})

    # ---- shared --------------------------------------------------------------------------
    async def _open(self, reqs: list[gateway_pb2.GenerateRequest], request: Request,
                    renames: dict[str, str] | None = None) -> list:
        """Each request validated by the gRPC path (GatewayServicer.open_stream)."""
        deadline = self.servicer.deadline()
        streams = []
        for req in reqs:
            try:
                streams.append(await self.servicer.open_stream(req, deadline))
            except PublicError as e:
                raise from_public(e, renames) from None
        return streams

    def _replies(self, streams: list) -> AsyncIterator[tuple[int, gateway_pb2.GenerateResponse]]:
        return merged([self.servicer.replies(s) for s in streams])


def servicer_error(e: ValueError) -> OpenAIError:
    """GatewayServicer.check_model's refusal."""
    if isinstance(e, UnknownModel):
        return OpenAIError(404, str(e), "model", "model_not_found")
    return bad_request(str(e), "model")


def _refuse_unsupported(body) -> None:
    refused = body.unsupported()
    if refused is not None:
        field, why = refused
        raise bad_request(why, field)


def _prompts(prompt) -> list[str | list[int]]:
    """The prompts of a completions request: a string, a list of token ids, or a list of
    either."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    if len(prompt) > MAX_PROMPTS:
        raise bad_request(f"prompt has {len(prompt)} prompts; one request takes at most {MAX_PROMPTS}", "prompt")
    return list(prompt)


def _message(m: schemas.ChatMessage, i: int) -> dict:
    """A message as the template sees it: content a string (text parts joined)."""
    out = m.model_dump(exclude_none=True)
    content = m.content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"messages[{i}].content[{j}]: only text parts are supported",
                                  f"messages.{i}.content")
            texts.append(part["text"])
        content = "".join(texts)
    out["content"] = content if content is not None else ""
    return out


def _int(name: str, value: int, low: int, high: int) -> int:
    """value within a proto field's range, else a 400 naming the field."""
    if not low <= value <= high:
        raise bad_request(f"{name} must be an integer in [{low}, {high}], got {value}", name)
    return value


def _sampling(body, max_tokens: int, max_tokens_name: str = "max_tokens") -> common_pb2.SamplingParams:
    """The request's sampling fields as the gRPC path's message; their values are checked
    by the gRPC path's validation (except what the message itself cannot hold)."""
    s = common_pb2.SamplingParams(
        max_tokens=_int(max_tokens_name, max_tokens, -INT32_MAX, INT32_MAX),
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=-1 if body.top_k is None else _int("top_k", body.top_k, -INT32_MAX, INT32_MAX),
        ignore_eos=body.ignore_eos)
    if body.top_p == 0.0:   # 0 on the wire means "the default", 1.0: say it is out of range instead
        raise bad_request("top_p must be in (0, 1], got 0.0", "top_p")
    if body.top_k == 0:
        raise bad_request("top_k must be -1 (disabled) or an integer >= 1, got 0", "top_k")
    if body.seed is not None:
        s.seed = _int("seed", body.seed, 0, 2**64 - 1)
    if body.num_logprobs is not None:
        s.logprobs = _int("logprobs", body.num_logprobs, 0, MAX_LOGPROBS)   # before any prompt is routed
    if body.stop is not None:
        s.stop.extend([body.stop] if isinstance(body.stop, str) else body.stop)
    for i, t in enumerate(body.stop_token_ids or ()):
        s.stop_token_ids.append(_int(f"stop_token_ids[{i}]", t, -INT32_MAX, INT32_MAX))
    return s


def _generate_request(request_id: str, model: str, prompt, sampling) -> gateway_pb2.GenerateRequest:
    req = gateway_pb2.GenerateRequest(request_id=request_id, model=model, sampling=sampling)
    if isinstance(prompt, str):
        req.prompt = prompt
    else:
        req.prompt_token_ids.ids.extend(_int(f"prompt[{i}]", t, -INT32_MAX, INT32_MAX) for i, t in enumerate(prompt))
    return req
