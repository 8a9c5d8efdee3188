"""A bound on one HTTP request body, before the app sees any of it.

FastAPI parses a whole JSON body into memory before any field is checked, and uvicorn
reads bodies of any size; the gRPC port caps a message at 64 MiB. `BodyLimit` is the
ASGI layer in front of the app: it reads the body itself (Content-Length or chunked),
answers 413 in OpenAI's error shape as soon as it is past `max_bytes` (a Content-Length
past it without reading a byte), and otherwise hands the app the body in one piece.
MAX_BODY_BYTES fits the largest request the limits allow (a batch of prompts near
limits.max_prompt_bytes each is refused field by field after parsing, not here).
"""
from __future__ import annotations

import json

MAX_BODY_BYTES = 32 << 20
# Connections and requests uvicorn serves at once; beyond, it answers 503 (the gRPC
# server's bound on concurrent calls is the same idea).
MAX_CONCURRENCY = 1024


class BodyLimit:
    def __init__(self, app, max_bytes: int = MAX_BODY_BYTES):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                return await self._refuse(send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":   # the client left: the app sees it so
                return await self.app(scope, _replay([message], receive), send)
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._refuse(send)
            if not message.get("more_body", False):
                break
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        return await self.app(scope, _replay([body], receive), send)

    async def _refuse(self, send) -> None:
        payload = json.dumps({"error": {
            "message": f"the request body is larger than {self.max_bytes} bytes",
            "type": "invalid_request_error", "param": None, "code": "request_too_large"}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(payload)).encode()), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": payload})


def _replay(messages: list[dict], receive):
    """A receive() that gives `messages` first, then whatever comes (a disconnect)."""
    pending = list(messages)

    async def replayed():
        return pending.pop(0) if pending else await receive()
    return replayed
