"""The OpenAI API's request bodies (pydantic) and response shapes (plain dicts).

Requests: the fields of OpenAI's /v1/completions and /v1/chat/completions, plus vLLM's
extensions `top_k`, `ignore_eos`, `stop_token_ids`, `return_token_ids` (each choice, and
each chunk, then carries the ids of its tokens as `token_ids`), `add_generation_prompt`
and `chat_template_kwargs`. Unknown fields are ignored (clients send e.g. `user`).
Types are checked here (a wrong type is a 400 naming the field); values are checked by
the gRPC path's own validation (common/engine/validation.py). Fields the mesh cannot
serve (n > 1, echo, penalties, tools, ...) are refused by `unsupported`. `logprobs`
(completions: the number of top tokens; chat: `logprobs` + `top_logprobs`) become
sampling.logprobs; their answers' shapes: logprobs.py.

Responses: `usage` carries `prompt_tokens_details.cached_tokens` (the prompt tokens
whose KV came from a prefix cache). Streamed chunks (CompletionChunks, ChatChunks): with
`stream_options.include_usage` every chunk has `"usage": null` and one last chunk has
`"choices": []` and the usage; a chat stream opens with the assistant role and ends each
choice with an empty delta carrying finish_reason.
"""
from __future__ import annotations

import time

from pydantic import BaseModel, ConfigDict, Field

from common.engine.sampling_params import MAX_LOGPROBS
from protos.pdmesh.v1 import common_pb2, gateway_pb2
from services.gateway.openai_http.errors import CHAT_RENAMES
from services.gateway.openai_http.logprobs import ChatLogprobs, CompletionLogprobs, TokenTexts


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Request(BaseModel):
    """What both endpoints share."""

    model_config = ConfigDict(extra="ignore")
    model: str = ""
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict | None = None
    return_token_ids: bool = False

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def unsupported(self) -> tuple[str, str] | None:
        """(field, why) for the first field set to what the mesh cannot serve."""
        if self.n != 1:
            return "n", "n must be 1 (one choice per prompt)"
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                return name, f"{name} is not supported (only 0)"
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options is only allowed with stream: true"
        return None


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @property
    def num_logprobs(self) -> int | None:
        """sampling.logprobs: the number of top tokens, None = no logprobs."""
        return self.logprobs

    def unsupported(self) -> tuple[str, str] | None:
        if self.echo:
            return "echo", "echo is not supported"
        if self.best_of not in (None, 1):
            return "best_of", "best_of must be 1"
        if self.suffix:
            return "suffix", "suffix is not supported"
        return super().unsupported()


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")   # name, tool_call_id, ...: passed to the template
    role: str
    content: str | list[dict] | None = None


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list | None = None
    response_format: dict | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict | None = None

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def unsupported(self) -> tuple[str, str] | None:
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs is only allowed with logprobs: true"
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            return "top_logprobs", f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.top_logprobs}"
        if self.tools:
            return "tools", "tools are not supported (no tool-call parsing)"
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            return "response_format", "response_format must be {\"type\": \"text\"}"
        return super().unsupported()


# ---- responses ---------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def add_usage(total: list[int], msg: common_pb2.Usage) -> None:
    """total: [prompt, completion, cached], summed over a batch's prompts."""
    total[0] += msg.prompt_tokens
    total[1] += msg.completion_tokens
    total[2] += msg.cached_prompt_tokens


def envelope(request_id: str, obj: str, model: str, choices: list[dict], created: int | None = None) -> dict:
    return {"id": request_id, "object": obj, "created": created or int(time.time()), "model": model,
            "choices": choices}


def completion_choice(index: int, text: str, finish_reason: str | None, token_ids: list[int] | None,
                      logprobs: dict | None = None) -> dict:
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason or None}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def chat_choice(index: int, text: str, finish_reason: str | None, token_ids: list[int] | None,
                logprobs: dict | None = None) -> dict:
    choice = {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
              "finish_reason": finish_reason or None}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def chat_delta(index: int, delta: dict, finish_reason: str | None, token_ids: list[int] | None,
               logprobs: dict | None = None) -> dict:
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason or None}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def model_card(model_id: str, max_model_len: int, created: int) -> dict:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "pdmesh",
            "max_model_len": max_model_len}


# ---- streamed chunks ---------------------------------------------------------------------
class CompletionChunks:
    """The chunks of a streamed /v1/completions answer."""

    renames = None                     # HTTP field renames for errors (errors.from_public)
    object_name = "text_completion"

    def __init__(self, request_id: str, model: str, body: CompletionRequest, texts: TokenTexts):
        self.id, self.model, self.body = request_id, model, body
        self.created = int(time.time())
        self.total = [0, 0, 0]
        self.texts = texts
        self._logprobs: dict[int, CompletionLogprobs | ChatLogprobs] = {}   # per choice index

    def logprobs(self, index: int, reply: gateway_pb2.GenerateResponse) -> dict | None:
        """The `logprobs` of reply's tokens in choice index, None when not asked for."""
        if self.body.num_logprobs is None:
            return None
        shape = self._logprobs.get(index)
        if shape is None:
            shape = self._logprobs[index] = self.logprobs_shape(self.texts, self.body.num_logprobs)
        return shape.of(reply.logprobs)

    logprobs_shape = CompletionLogprobs

    def has_logprobs(self, reply: gateway_pb2.GenerateResponse) -> bool:
        """Whether reply has tokens whose logprobs the client asked for (a chunk then
        carries them even when their text is still held back)."""
        return self.body.num_logprobs is not None and len(reply.token_ids) > 0

    def _chunk(self, choices: list[dict]) -> dict:
        chunk = envelope(self.id, self.object_name, self.model, choices, self.created)
        if self.body.include_usage:
            chunk["usage"] = None
        return chunk

    def opening(self) -> list[dict]:
        return []

    def chunks(self, index: int, reply: gateway_pb2.GenerateResponse) -> list[dict]:
        ids = list(reply.token_ids) if self.body.return_token_ids else None
        if reply.finish_reason:
            add_usage(self.total, reply.usage)
        elif not reply.text and not ids and not self.has_logprobs(reply):
            return []
        return [self._chunk([completion_choice(index, reply.text, reply.finish_reason, ids,
                                               self.logprobs(index, reply))])]

    def closing(self) -> list[dict]:
        if not self.body.include_usage:
            return []
        return [{**self._chunk([]), "usage": usage(*self.total)}]


class ChatChunks(CompletionChunks):
    """The chunks of a streamed /v1/chat/completions answer: the role first, then the
    content, then a chunk with the finish reason and an empty delta."""

    renames = CHAT_RENAMES
    object_name = "chat.completion.chunk"
    logprobs_shape = ChatLogprobs

    def opening(self) -> list[dict]:
        return [self._chunk([chat_delta(0, {"role": "assistant", "content": ""}, None, None)])]

    def chunks(self, index: int, reply: gateway_pb2.GenerateResponse) -> list[dict]:
        ids = list(reply.token_ids) if self.body.return_token_ids else None
        out = []
        if reply.text or ids or self.has_logprobs(reply):
            out.append(self._chunk([chat_delta(index, {"content": reply.text}, None, ids,
                                               self.logprobs(index, reply))]))
        if reply.finish_reason:
            add_usage(self.total, reply.usage)
            out.append(self._chunk([chat_delta(index, {}, reply.finish_reason, None)]))
        return out
