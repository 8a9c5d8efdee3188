"""Decode servicer (also serves `both` nodes).

Lifecycle of a Generate RPC here (the request's states: common/engine/lifecycle.py):
  validate -> queue full? RESOURCE_EXHAUSTED
  -> admitted: blocks allocated for the prompt (local prefix hits first)
  -> prefill: by the routed prefill node (it writes our blocks, returns the first token;
     a full one passes to the route's fallbacks), or locally when none is given or the
     prefill fails (services/decode/remote_prefill.py); the call's deadline bounds it.
     A request with sampling.prompt_logprobs is always prefilled here (every prompt
     position needs its logits): its first message carries them
  -> continuous-batching decode; one message per new token; the last carries
     finish_reason and usage
The engine dies (its step loop raised): every request in flight fails UNAVAILABLE, so
the gateway migrates it (services/node/node_health.py takes the node out of the mesh).
Client cancel (the gateway cancels the call): the request is aborted; a remote prefill in
flight is cancelled first, and its blocks are freed once its writes are known to have
stopped (QUARANTINED until then).
"""
from __future__ import annotations

import logging
import time

import grpc

from common.timeline import mark
from common.engine.async_engine import EngineDeadError
from protos.pdmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from common.engine.validation import validate_resume_position
from services.convert import logprobs_to_proto, prompt_logprobs_to_proto, sampling_from_proto, usage
from services.decode.remote_prefill import RemotePrefill
from services.node.engine_node import EngineNode

log = logging.getLogger("pdmesh.decode")


class DecodeServicer(engine_pb2_grpc.DecodeServicer):
    def __init__(self, node: EngineNode):
        self.node = node

    async def Generate(self, request, context):
        rid, prompt = request.request_id, list(request.prompt_token_ids)
        mark("decode.in", rid)
        engine = self.node.engine
        try:
            params = sampling_from_proto(request.sampling)
            engine.validate(rid, prompt, params)
            validate_resume_position(request.resume_position, len(prompt))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if engine.num_waiting() >= self.node.node.max_queue:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"decode node {self.node.node.node_id} has {self.node.node.max_queue} "
                                "requests waiting; retry later")
        remaining = context.time_remaining()
        deadline = time.monotonic() + (remaining if remaining is not None else self.node.mesh.timeouts.request_s)
        remote = None
        if request.HasField("prefill") and request.prefill.address and params.prompt_logprobs is None:
            remote = RemotePrefill(self.node, request, deadline)
        num_out = 0
        start = time.perf_counter()
        try:
            async for out in engine.generate(rid, prompt, params, remote=remote,
                                             resume_position=request.resume_position):
                reply = engine_pb2.DecodeResponse(token_ids=out.new_token_ids)
                if out.new_logprobs:
                    reply.logprobs.extend(logprobs_to_proto(lp) for lp in out.new_logprobs)
                if out.prompt_logprobs is not None:
                    reply.prompt_logprobs.extend(prompt_logprobs_to_proto(out.prompt_logprobs))
                if num_out == 0:
                    mark("decode.first_out", rid)
                    reply.prefill_timing.CopyFrom(self._timing(remote, out, time.perf_counter() - start))
                    self.node.metrics.queue_time.observe(out.queue_s)
                num_out += len(out.new_token_ids)
                if out.finished:
                    reply.finish_reason = out.finish_reason or ""
                    cached = out.num_cached_tokens
                    if remote is not None and remote.reply is not None:
                        cached = remote.reply.num_cached_tokens
                    reply.usage.CopyFrom(usage(len(prompt), num_out, cached))
                yield reply
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except EngineDeadError as e:
            # UNAVAILABLE: the gateway moves the request to another decode node
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"decode node engine failed: {e}")

    @staticmethod
    def _timing(remote, out, elapsed_s: float) -> common_pb2.PrefillTiming:
        if remote is not None and remote.reply is not None:
            return remote.reply.timing
        return common_pb2.PrefillTiming(queue_ms=out.queue_s * 1e3,
                                        compute_ms=(elapsed_s - out.queue_s) * 1e3)

    async def GetEngineStats(self, request, context):
        return await self.node.engine_stats()
