"""PrefillStream: a decode node's Prefill and CancelPrefill calls over one long-lived
stream (services/call_stream), answered by the unary handlers of PrefillServicer.

Lifecycle of one prefill call on the stream:
  PrefillStreamRequest(prefill) -> PrefillServicer.Prefill in its own task
  -> answered with its PrefillResponse or the status the unary RPC would end with
Stopping it (a cancel_call_id request, its timeout_s, or the end of the stream when the
decode node goes away): the prefill's KV writes are stopped and those in flight awaited
(and its kv-store reads), then its task is cancelled, which aborts it in the engine and
frees its blocks; the call is answered CANCELLED (DEADLINE_EXCEEDED past its timeout),
and only then is the cancel answered. So once a cancel is answered, no write of that
prefill can land in the decode node's blocks.
"""
from __future__ import annotations

import grpc

from protos.pdmesh.v1 import engine_pb2
from services.call_stream import CallContext, CallError, CallStreamServer


async def serve_prefill_stream(servicer, request_iterator, context) -> None:
    """servicer: a PrefillServicer (Prefill, stop_writes). Returns when the stream ends."""
    async def handle(request) -> engine_pb2.PrefillStreamResponse:
        kind = request.WhichOneof("call")
        if kind == "prefill":
            reply = await servicer.Prefill(request.prefill, CallContext(request.timeout_s))
            return engine_pb2.PrefillStreamResponse(prefill=reply)
        if kind == "cancel_call_id":
            was_running = await calls.cancel(request.cancel_call_id)
            return engine_pb2.PrefillStreamResponse(
                cancel=engine_pb2.CancelPrefillResponse(was_running=was_running))
        raise CallError(grpc.StatusCode.INVALID_ARGUMENT, "one of prefill or cancel_call_id is required")

    async def stop(request) -> None:
        if request.WhichOneof("call") == "prefill":
            await servicer.stop_writes(request.prefill.request_id)

    calls = CallStreamServer(handle, engine_pb2.PrefillStreamResponse, on_cancel=stop)
    await calls.serve(request_iterator, context)
