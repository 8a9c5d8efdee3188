"""BodyLimit: bodies past the bound are refused with 413 before the app sees a byte; the
others reach it whole, chunked or not (a real uvicorn server, raw HTTP)."""
from __future__ import annotations

import asyncio
import json

from services.gateway.openai_http.server import HttpServer


def _echo_app(seen: list[bytes]):
    async def app(scope, receive, send):
        message = await receive()
        seen.append(message["body"])
        assert not message.get("more_body", False)
        reply = str(len(message["body"])).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain"), (b"content-length", str(len(reply)).encode())]})
        await send({"type": "http.response.body", "body": reply})
    return app


async def _post(port: int, head: str, body: bytes) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head.encode() + body)
    await writer.drain()
    reply = await reader.read()
    writer.close()
    status = int(reply.split(b" ", 2)[1])
    return status, reply.split(b"\r\n\r\n", 1)[1]


def test_bodies_past_the_limit_are_refused_before_the_app_and_the_others_arrive_whole():
    seen: list[bytes] = []

    async def scenario():
        server = HttpServer(_echo_app(seen), "127.0.0.1", 0, max_body_bytes=1000)
        port = await server.start()
        try:
            ok = await _post(port, "POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 1000\r\nconnection: close\r\n\r\n",
                             b"a" * 1000)
            big = await _post(port, "POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 1001\r\nconnection: close\r\n\r\n",
                              b"")
            chunk = b"b" * 600
            frame = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
            chunked_head = "POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n"
            chunked_big = await _post(port, chunked_head, frame * 2 + b"0\r\n\r\n")
            chunked_ok = await _post(port, chunked_head, frame + b"0\r\n\r\n")
        finally:
            await server.stop()
        return ok, big, chunked_big, chunked_ok

    ok, big, chunked_big, chunked_ok = asyncio.run(scenario())
    assert ok == (200, b"1000") and chunked_ok == (200, b"600")
    for status, body in (big, chunked_big):
        assert status == 413
        assert json.loads(body)["error"] == {"message": "the request body is larger than 1000 bytes",
                                             "type": "invalid_request_error", "param": None,
                                             "code": "request_too_large"}
    assert seen == [b"a" * 1000, b"b" * 600]
