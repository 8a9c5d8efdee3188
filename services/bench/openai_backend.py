"""The openai backend: an OpenAI-compatible server's streamed completions (vLLM, SGLang,
...), timed as every backend is (services/bench/base.py), so one command measures them
and pdmesh alike.

    OpenAIBackend(base_url="http://127.0.0.1:8000", model="", api_key_file="")

A request is `POST {base_url}/v1/completions` with

    {"model", "prompt": [token ids] | "text", "max_tokens", "temperature": 0, "stream": true,
     "stream_options": {"include_usage": true}, "return_token_ids": true,
     "ignore_eos": true (only when the request asks for it)}

and the answer an SSE stream (`data: {json}` events, a blank line after each, then
`data: [DONE]`). A chunk "carries tokens" when its choice has a non-empty `token_ids`
(vLLM's return_token_ids; a chunk with ids but no text yet still counts), or, from a
server that sends no ids, a non-empty `text`. Output tokens: the streamed ids when there
are any, else the final usage's completion_tokens, else one per chunk with tokens.

Errors (RequestResult.error): "HTTP_<status>" for a refused request, "STREAM_ERROR" for an
`{"error": ...}` event, "BAD_STREAM" for an event that is not JSON, "INCOMPLETE" for a
stream that ended without [DONE], "UNAVAILABLE" when the connection failed or broke,
"DEADLINE_EXCEEDED" after timeout_s (the gRPC names where one fits).

model "" is the first model of GET /v1/models. The API key, if any, is --api-key-file's
first key or $OPENAI_API_KEY (never the local mesh's: this backend talks to other servers).
"""
from __future__ import annotations

import asyncio
import json
import os
import time

import aiohttp

from services.bench.base import Backend, ModelInfo, ServerUnreachable
from services.bench.datasets import BenchRequest
from services.bench.metrics import RequestResult

DONE = "[DONE]"


class SSEDecoder:
    """Server-sent events from a byte stream fed in arbitrary pieces: feed(bytes) returns
    the data of each event completed so far (its `data:` lines joined by "\\n"); comments
    and the other fields (event, id, retry) are dropped; LF, CRLF or CR end a line.
    close() returns the data of an event the stream left unterminated (lenient: the
    spec drops it). Not thread-safe."""

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        self._buffer += chunk
        events = []
        while True:
            cut = _line_end(self._buffer)
            if cut is None:
                return events
            end, after = cut
            line, self._buffer = self._buffer[:end].decode("utf-8", "replace"), self._buffer[after:]
            if not line:
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
                continue
            field, _, value = line.partition(":")
            if field == "data":
                self._data.append(value[1:] if value.startswith(" ") else value)

    def close(self) -> list[str]:
        pending = self.feed(b"\n\n") if self._buffer or self._data else []
        self._buffer = b""
        return pending


def _line_end(buffer: bytes) -> tuple[int, int] | None:
    """(end of the first line, start of the next) or None when no line is complete. A CR
    at the very end waits for the next byte (it may be half of a CRLF)."""
    lf, cr = buffer.find(b"\n"), buffer.find(b"\r")
    if cr < 0 or (0 <= lf < cr):
        return None if lf < 0 else (lf, lf + 1)
    if cr + 1 == len(buffer):
        return None
    return cr, cr + 2 if buffer[cr + 1:cr + 2] == b"\n" else cr + 1


def completion_body(req: BenchRequest, model: str) -> dict:
    body = {"model": model, "prompt": list(req.prompt_token_ids) if req.prompt_token_ids else req.prompt,
            "max_tokens": req.max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True}
    if req.ignore_eos:
        body["ignore_eos"] = True
    return body


def _api_key(api_key_file: str) -> str | None:
    if api_key_file:
        from services.security.credentials import read_api_keys
        return read_api_keys(api_key_file)[0].decode()
    return os.environ.get("OPENAI_API_KEY", "").strip() or None


class _Stream:
    """One request's timing as its events arrive."""

    def __init__(self, result: RequestResult, start: float):
        self.result, self.start, self.last = result, start, None
        self.usage_tokens = 0
        self.num_chunks_with_tokens = 0
        self.done = False

    def on_event(self, data: str, now: float) -> None:
        if data.strip() == DONE:
            self.done = True
            return
        try:
            event = json.loads(data)
        except json.JSONDecodeError:
            raise _StreamFailed("BAD_STREAM") from None
        if not isinstance(event, dict) or event.get("error"):
            raise _StreamFailed("STREAM_ERROR")
        try:
            self._on_fields(event, now)
        except (TypeError, ValueError, AttributeError, KeyError, IndexError):   # fields of the wrong shape
            raise _StreamFailed("BAD_STREAM") from None

    def _on_fields(self, event: dict, now: float) -> None:
        usage = event.get("usage") or {}
        if usage:
            self.usage_tokens = int(usage.get("completion_tokens") or 0)
            self.result.num_prompt_tokens = int(usage.get("prompt_tokens") or 0) or self.result.num_prompt_tokens
        choice = (event.get("choices") or [{}])[0]
        token_ids = choice.get("token_ids") or []
        if not (token_ids or ("token_ids" not in choice and choice.get("text"))):
            return
        if self.last is None:
            self.result.ttft_s = now - self.start
        else:
            self.result.itl_s.append(now - self.last)
        self.last = now
        self.num_chunks_with_tokens += 1
        self.result.output_token_ids.extend(int(i) for i in token_ids)

    def finish(self, now: float) -> None:
        if not self.done:
            raise _StreamFailed("INCOMPLETE")
        r = self.result
        r.num_output_tokens = len(r.output_token_ids) or self.usage_tokens or self.num_chunks_with_tokens
        r.e2e_s = now - self.start


class _StreamFailed(Exception):
    pass


class OpenAIBackend(Backend):
    name = "openai"

    def __init__(self, base_url: str, model: str = "", api_key_file: str = "", timeout_s: float = 600.0):
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"--base-url must start with http:// or https://, got {base_url!r}")
        self.base_url, self.model, self.timeout_s = base_url.rstrip("/"), model, timeout_s
        key = _api_key(api_key_file)
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:   # made inside the running loop, as aiohttp asks
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0), headers=self._headers,
                timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        return self._session

    async def model_info(self) -> ModelInfo:
        url = f"{self.base_url}/v1/models"
        try:
            async with self._client().get(url, timeout=aiohttp.ClientTimeout(total=30)) as resp:
                resp.raise_for_status()
                models = (await resp.json())["data"]
        except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, TypeError, ValueError) as e:
            raise ServerUnreachable(f"GET {url}: {type(e).__name__}: {e}") from None
        card = next((m for m in models if not self.model or m["id"] == self.model), None)
        if card is None:
            raise ValueError(f"{self.base_url} serves no model {self.model!r}; it serves "
                             f"{', '.join(m['id'] for m in models)}")
        self.model = card["id"]
        return ModelInfo(card["id"], int(card.get("vocab_size") or 0), int(card.get("max_model_len") or 0))

    async def one_request(self, req: BenchRequest) -> RequestResult:
        result = RequestResult(num_prompt_tokens=req.num_prompt_tokens)
        decoder = SSEDecoder()
        start = time.perf_counter()
        stream = _Stream(result, start)
        try:
            async with self._client().post(f"{self.base_url}/v1/completions",
                                           json=completion_body(req, self.model)) as resp:
                if resp.status != 200:
                    await resp.read()
                    result.error = f"HTTP_{resp.status}"
                    return result
                async for chunk in resp.content.iter_any():
                    now = time.perf_counter()
                    for data in decoder.feed(chunk):
                        stream.on_event(data, now)
            now = time.perf_counter()
            for data in decoder.close():
                stream.on_event(data, now)
            stream.finish(now)
        except _StreamFailed as e:
            result.error = str(e)
        except asyncio.TimeoutError:
            result.error = "DEADLINE_EXCEEDED"
        except aiohttp.ClientError:
            result.error = "UNAVAILABLE"
        return result

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
