"""A request that does not parse is the caller's error: INVALID_ARGUMENT, not UNKNOWN.

gRPC runs a handler's request_deserializer before the servicer sees the call, and answers
one that raises (protobuf's DecodeError: truncated bytes, invalid UTF-8 in a `string`
field) with UNKNOWN "Unexpected <class ...>" and a traceback in the log. This interceptor,
on every server after the authentication one (a refused call is never parsed at all),
gives each unary-request handler a deserializer that cannot raise and a behavior that
ends such a call with INVALID_ARGUMENT. Handlers whose deserializer is marked tolerant
(`never_raises = True`: the gateway's, services/gateway/wire.py) and those without one
(raw-bytes transfer streams) are left alone.
"""
from __future__ import annotations

import inspect

import grpc

MESSAGE = "the request is not a valid protobuf message of this method (truncated, or a string field is not UTF-8)"


class _Malformed:
    """Stands in for a request whose bytes did not parse."""


MALFORMED = _Malformed()


def _safe(deserializer):
    def deserialize(data: bytes):
        try:
            return deserializer(data)
        except Exception:   # DecodeError and anything a parser can raise on hostile bytes
            return MALFORMED
    return deserialize


def _wrapped(handler, is_async: bool):
    deserializer = None if handler is None else handler.request_deserializer
    if (deserializer is None or getattr(deserializer, "never_raises", False)
            or not (handler.unary_unary or handler.unary_stream)):
        return handler
    inner = handler.unary_unary or handler.unary_stream
    if is_async and inspect.isasyncgenfunction(inner):
        async def behavior(request, context):
            if request is MALFORMED:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, MESSAGE)
            async for reply in inner(request, context):
                yield reply
    elif is_async:
        async def behavior(request, context):
            if request is MALFORMED:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, MESSAGE)
            return await inner(request, context)
    elif inspect.isgeneratorfunction(inner) or handler.unary_stream:
        def behavior(request, context):
            if request is MALFORMED:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, MESSAGE)
            yield from inner(request, context)
    else:
        def behavior(request, context):
            if request is MALFORMED:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, MESSAGE)
            return inner(request, context)
    make = grpc.unary_unary_rpc_method_handler if handler.unary_unary else grpc.unary_stream_rpc_method_handler
    return make(behavior, _safe(handler.request_deserializer), handler.response_serializer)


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation, details):
        return _wrapped(await continuation(details), is_async=True)


class SyncMalformedRequestInterceptor(grpc.ServerInterceptor):
    def intercept_service(self, continuation, details):
        return _wrapped(continuation(details), is_async=False)
