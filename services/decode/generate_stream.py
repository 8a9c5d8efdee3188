"""GenerateStream: a gateway's Generate calls over one long-lived stream
(services/call_stream), each served by DecodeServicer.Generate.

Lifecycle of one call on the stream: GenerateStreamRequest(generate) -> Generate in its
own task -> each DecodeResponse sent at once; the one with finish_reason is the last
(end set); an error ends the call with the status Generate would end with. A cancel
request, the call's timeout_s, or the end of the stream (the gateway went away) cancels
the task, which aborts the request and frees its blocks as cancelling Generate does.
"""
from __future__ import annotations

import grpc

from protos.pdmesh.v1 import engine_pb2
from services.call_stream import CallContext, CallError, CallStreamServer


async def serve_generate_stream(servicer, request_iterator, context) -> None:
    """servicer: a DecodeServicer. Returns when the stream ends."""
    async def handle(request):
        if not request.HasField("generate"):
            raise CallError(grpc.StatusCode.INVALID_ARGUMENT, "generate is required")
        async for reply in servicer.Generate(request.generate, CallContext(request.timeout_s)):
            yield engine_pb2.GenerateStreamResponse(response=reply, end=bool(reply.finish_reason))

    await CallStreamServer(handle, engine_pb2.GenerateStreamResponse).serve(request_iterator, context)
