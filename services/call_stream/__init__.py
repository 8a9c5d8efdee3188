"""Many concurrent calls over one long-lived bidi gRPC stream, instead of one RPC each.

Why: between two processes on this host a new RPC costs ~1 ms more than a message on a
stream that is already open (a new HTTP/2 stream, headers, a server task, trailers; more
when the processes were idle). Hops on every request's critical path (gateway ->
meta-server Route, gateway -> decode Generate, decode -> prefill Prefill) therefore go
over one such stream per peer.

Wire contract of every `*Stream` RPC built on this package:
  - each request message carries a `call_id` (uint64, unique on its stream) and may carry
    `timeout_s` (0 = none: past it the server stops the call, DEADLINE_EXCEEDED);
  - a unary call (the response message has no `end` field) is answered by exactly one
    response of its call_id, in any order relative to other calls;
  - a streaming call (the response message has `end`) is answered by responses of its
    call_id, the last with `end` set; a request with `cancel` set stops the call of its
    call_id (not answered: the client has left it);
  - a response's `code` (a grpc.StatusCode value, 0 = OK) and `message` carry the status
    the matching RPC would have ended with; the other fields are set only when OK;
  - the stream ends only when a side goes away or the client closes it. The client then
    fails every call still open with the stream's status (UNAVAILABLE if it ended
    cleanly); the server stops every call of the stream still running and waits for
    each to finish before the handler returns.

    client = CallStreamClient(stub.RouteStream)                # opened at the first call
    reply = await client.call(meta_pb2.RouteStreamRequest(route=...), timeout=5)
    # raises grpc.aio.AioRpcError: the response's code, the stream's, or DEADLINE_EXCEEDED
    call = client.open(engine_pb2.GenerateStreamRequest(generate=...), timeout=600)
    async for response in call: ...                            # call.cancel() to leave

    async def RouteStream(self, request_iterator, context):      # server side
        await CallStreamServer(handle, meta_pb2.RouteStreamResponse).serve(request_iterator, context)

Thread-safety: event loop only (both sides).
"""
from __future__ import annotations

import time

import grpc

STATUS_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """The error an RPC would raise with this status."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class CallError(Exception):
    """A call's failure as a status code, answered on the stream (server side)."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


class CallContext:
    """Stands in for an RPC handler's ServicerContext when the handler serves a call of a
    stream: `await context.abort(code, details)` raises CallError instead. Only what
    our handlers use is here (abort, and the read-only cancelled, peer,
    invocation_metadata, time_remaining)."""

    def __init__(self, timeout_s: float = 0.0):
        self._deadline = time.monotonic() + timeout_s if timeout_s > 0 else None

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata=()):
        raise CallError(code, details)

    def cancelled(self) -> bool:
        return False  # a stopped call's task is cancelled instead

    def peer(self) -> str:
        return "call-stream"

    def invocation_metadata(self) -> tuple:
        return ()

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())


from services.call_stream.client import CallStreamClient, StreamingCall  # noqa: E402
from services.call_stream.server import CallStreamServer  # noqa: E402

__all__ = ["CallContext", "CallError", "CallStreamClient", "CallStreamServer", "StreamingCall",
           "rpc_error", "STATUS_BY_VALUE"]
