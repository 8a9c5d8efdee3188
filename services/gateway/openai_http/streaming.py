"""Server-sent events and client disconnects, for the HTTP routes (app.py).

A streamed answer: the first reply is awaited before the response starts, so that what
fails before any token is an HTTP error (429, 503, ...); then one `data: {chunk}` event
per chunk, and `data: [DONE]` last. An error after the first token is one
`data: {"error": ...}` event (OpenAI's shape, errors.py), then `data: [DONE]`.

Client disconnect: a streaming response is cancelled by Starlette when the client
leaves (its body iterator is then closed here at once, not when it is garbage
collected); a non-streaming one by a watcher on the connection (until_disconnected).
Either way every prompt's replies() iterator is closed, which cancels its decode call:
the decode node aborts the request and frees its blocks. Event loop only.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from protos.pdmesh.v1 import common_pb2, gateway_pb2
from services.gateway import public_errors
from services.gateway.openai_http.errors import from_public
from services.gateway.public_errors import PublicError

DONE = b"data: [DONE]\n\n"


class ClientGone(Exception):
    """The client closed the connection before the answer was ready."""


async def merged(iterators: list) -> AsyncIterator[tuple[int, gateway_pb2.GenerateResponse]]:
    """(index, reply) from every iterator as they come; the first error is raised (the
    others then stop). Closing this closes every iterator (cancels their requests)."""
    if len(iterators) == 1:   # the common case: no task, no queue
        async with aclosing(iterators[0]) as replies:
            async for reply in replies:
                yield 0, reply
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, it) -> None:
        try:
            async with aclosing(it) as replies:
                async for reply in replies:
                    queue.put_nowait((index, reply, None))
            queue.put_nowait((index, None, None))
        except Exception as e:
            queue.put_nowait((index, None, e))

    tasks = [asyncio.ensure_future(pump(i, it)) for i, it in enumerate(iterators)]
    try:
        left = len(tasks)
        while left:
            index, reply, error = await queue.get()
            if error is not None:
                raise error
            if reply is None:
                left -= 1
            else:
                yield index, reply
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect(replies, num_prompts: int) -> list[tuple[str, list[int], str, common_pb2.Usage, list]]:
    """Every prompt's (text, token ids, finish_reason, usage, TokenLogprobs of its tokens)."""
    texts = [[] for _ in range(num_prompts)]
    ids = [[] for _ in range(num_prompts)]
    logprobs = [[] for _ in range(num_prompts)]
    finish = [""] * num_prompts
    usage = [common_pb2.Usage() for _ in range(num_prompts)]
    async with aclosing(replies):
        async for i, reply in replies:
            texts[i].append(reply.text)
            ids[i].extend(reply.token_ids)
            logprobs[i].extend(reply.logprobs)
            if reply.finish_reason:
                finish[i] = reply.finish_reason
                usage[i] = reply.usage
    return [("".join(texts[i]), ids[i], finish[i], usage[i], logprobs[i]) for i in range(num_prompts)]


async def until_disconnected(request: Request, work):
    """await work; ClientGone (work cancelled) if the client closes the connection first."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientGone()
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def _disconnect(request: Request) -> None:
    """Returns when the client has closed the connection (the body was read already, so
    the next ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class SSEResponse(StreamingResponse):
    """Server-sent events whose body iterator and `replies` are closed however the
    response ends (the client left: Starlette cancels the sending; even before the body
    started), so that the requests are cancelled here and then, not whenever the
    iterators are garbage-collected."""

    media_type = "text/event-stream"

    def __init__(self, content, replies, **kwargs):
        super().__init__(content, **kwargs)
        self.replies = replies

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            await self.replies.aclose()


async def sse(request: Request, replies, chunks) -> Response:
    """The streaming response; the first reply is awaited first, so that what fails
    before any token is an HTTP error."""
    try:
        first = await until_disconnected(request, anext(replies, None))
    except BaseException:
        await replies.aclose()
        raise

    async def events() -> AsyncIterator[bytes]:
        try:
            async with aclosing(replies):
                for chunk in chunks.opening():
                    yield _event(chunk)
                item = first
                while item is not None:
                    for chunk in chunks.chunks(*item):
                        yield _event(chunk)
                    item = await anext(replies, None)
            for chunk in chunks.closing():
                yield _event(chunk)
        except PublicError as e:
            yield _event(from_public(e, chunks.renames).body())
        except Exception:
            yield _event(from_public(public_errors.internal_error("an HTTP stream")).body())
        yield DONE

    return SSEResponse(events(), replies, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n\n"
