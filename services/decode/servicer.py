"""Decode servicer (also serves `both` nodes).

Lifecycle of a Generate RPC here:
  validate -> queue full? RESOURCE_EXHAUSTED
  -> admitted: blocks allocated for the prompt (local prefix hits first)
  -> prefill: by the given prefill node (it writes our blocks, returns the first token),
     or locally when none is given or the prefill node fails
  -> continuous-batching decode; one message per new token; the last carries
     finish_reason and usage
Client cancel: the request is aborted, a running remote prefill cancelled first, and its
blocks freed.

GenerateStream carries a gateway's Generate calls over one long-lived stream
(services/decode/generate_stream.py); each call is served by Generate as above, and
leaving it (or the stream ending) is a client cancel.
"""
from __future__ import annotations

import logging
import time

import grpc

from common.engine.async_engine import EngineDeadError
from protos.pdmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from services.convert import sampling_from_proto, usage
from services.decode.generate_stream import serve_generate_stream
from services.decode.remote_prefill import PrefillStreams, RemotePrefillCall
from services.engine_node import EngineNode

log = logging.getLogger("pdmesh.decode")


class DecodeServicer(engine_pb2_grpc.DecodeServicer):
    def __init__(self, node: EngineNode):
        self.node = node
        self.prefill_streams = PrefillStreams(node)

    async def Generate(self, request, context):
        rid, prompt = request.request_id, list(request.prompt_token_ids)
        try:
            params = sampling_from_proto(request.sampling)
            self.node.llm_engine.validate_request(rid, prompt, params)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if len(self.node.llm_engine.scheduler.waiting) >= self.node.node.max_queue:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"decode node {self.node.node.node_id} has {self.node.node.max_queue} "
                                "requests waiting; retry later")
        remote = None
        if request.HasField("prefill") and request.prefill.address:
            remote = RemotePrefillCall(self.node, rid, prompt, request.sampling, request.prefill,
                                       self.node.node.prefill_timeout_s, self.prefill_streams)
        num_out = 0
        start = time.perf_counter()
        try:
            async for out in self.node.engine.generate(rid, prompt, params, remote=remote):
                reply = engine_pb2.DecodeResponse(token_ids=out.new_token_ids)
                if num_out == 0:
                    reply.prefill_timing.CopyFrom(self._timing(remote, out, time.perf_counter() - start))
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
            await context.abort(grpc.StatusCode.INTERNAL, f"engine failed: {e}")

    async def GenerateStream(self, request_iterator, context):
        """Generate calls of one gateway over one stream."""
        await serve_generate_stream(self, request_iterator, context)

    @staticmethod
    def _timing(remote, out, elapsed_s: float) -> common_pb2.PrefillTiming:
        if remote is not None and remote.reply is not None:
            return remote.reply.timing
        return common_pb2.PrefillTiming(queue_ms=out.queue_s * 1e3,
                                        compute_ms=(elapsed_s - out.queue_s) * 1e3)

    async def GetEngineStats(self, request, context):
        return self.node.engine_stats()
