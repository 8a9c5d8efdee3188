"""Gateway servicer: the public pdmesh.v1.Gateway API.

Lifecycle of a Generate RPC:
  validate + tokenize (INVALID_ARGUMENT naming the field)
  -> the request's deadline: timeouts.request_s, or the client's own deadline if sooner;
     every hop below gets what remains of it
  -> per attempt, a mesh request id minted here (the client's request_id is kept for logs
     only, so two clients may use the same one)
  -> Route at the meta-server with the prompt's block hashes (UNAVAILABLE when no decode
     node) -> the decode node's Generate stream (it prefills locally or through the
     prefill node, falling back to the other prefill nodes the route lists); a decode node
     that is UNAVAILABLE before sending anything (e.g. just died, not yet expired by the
     meta-server) or full (RESOURCE_EXHAUSTED) before sending anything is excluded and
     the request routed again as a new attempt
  -> incremental detokenization, stop strings -> GenerateResponse chunks; the last one
     has finish_reason (stop | length | abort) and usage
Client cancel: the decode call is cancelled, which aborts the request downstream.
"""
from __future__ import annotations

import logging
import time
import uuid

import grpc

from common.config import TimeoutConfig
from common.engine.stop_strings import StopStringMatcher
from common.hashing import hash_block_chain, layout_key
from common.model.detokenizer import IncrementalDetokenizer
from common.model.tokenizer import Tokenizer
from protos.pdmesh.v1 import engine_pb2, gateway_pb2, gateway_pb2_grpc, meta_pb2
from services.gateway.decode_client import DecodeClient
from services.gateway.meta_client import MetaClient
from common.engine.validation import validate_request
from services.convert import sampling_from_proto

log = logging.getLogger("pdmesh.gateway")
PASS_THROUGH = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
MAX_ROUTE_ATTEMPTS = 3
# before any token: the node is gone (not yet expired by the meta-server) or full
REROUTE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, tokenizer: Tokenizer, model_id: str, vocab_size: int, max_model_len: int,
                 meta_addresses: list[str] | str, timeouts: TimeoutConfig = TimeoutConfig()):
        self.tokenizer, self.model_id = tokenizer, model_id
        self.vocab_size, self.max_model_len = vocab_size, max_model_len
        if isinstance(meta_addresses, str):
            meta_addresses = [meta_addresses]
        self.timeouts = timeouts
        self.meta = MetaClient(meta_addresses, timeouts.meta_follow_s)
        self.decode = DecodeClient()
        self._hash_args: tuple[int, str, str] | None = None   # block_size, model_id, layout

    async def _block_hashes(self, ids: list[int]) -> list[bytes]:
        """The prompt's block hash chain as the nodes compute it (for cache-aware routing);
        block size and layout come from the first live node of our model; [] if none yet."""
        if self._hash_args is None:
            try:
                members = await self.meta.call("ListMembers", meta_pb2.ListMembersRequest(),
                                               timeout=self.timeouts.route_s)
            except grpc.aio.AioRpcError:
                return []
            for n in members.nodes:
                if n.model_id and n.kv_layout.block_size > 0:
                    self._hash_args = (n.kv_layout.block_size, n.model_id, layout_key(n.kv_layout))
                    break
            else:
                return []
        block_size, model_id, layout = self._hash_args
        return hash_block_chain(ids, block_size, model_id, layout)

    def _check_model(self, model: str) -> None:
        if model and model != self.model_id:
            raise ValueError(f"model {model!r} is not served here; available: [{self.model_id!r}]")

    def _prompt_ids(self, request) -> list[int]:
        which = request.WhichOneof("input")
        if which == "prompt":
            if not request.prompt:
                raise ValueError("prompt must not be empty")
            return self.tokenizer.encode(request.prompt)
        if which == "prompt_token_ids":
            return list(request.prompt_token_ids.ids)
        raise ValueError("one of prompt or prompt_token_ids is required")

    def _validate(self, request) -> tuple[list[int], object]:
        self._check_model(request.model)
        ids = self._prompt_ids(request)
        params = sampling_from_proto(request.sampling)
        validate_request(ids, params, self.vocab_size, self.max_model_len)
        return ids, params

    def _deadline(self, context) -> float:
        """The request's deadline (time.monotonic): request_s, or the client's if sooner."""
        remaining = self.timeouts.request_s
        client = context.time_remaining()
        if client is not None:
            remaining = min(remaining, client)
        return time.monotonic() + remaining

    async def Generate(self, request, context):
        try:
            ids, params = self._validate(request)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        deadline = self._deadline(context)
        client_id = request.request_id
        hashes = await self._block_hashes(ids)
        excluded: list[str] = []
        refused: tuple[grpc.StatusCode, str] | None = None   # the last decode node's answer
        for attempt in range(MAX_ROUTE_ATTEMPTS):
            rid = uuid.uuid4().hex  # the mesh's id of this attempt
            try:
                route = await self.meta.route(meta_pb2.RouteRequest(
                    request_id=rid, model_id=self.model_id, num_prompt_tokens=len(ids),
                    block_hashes=hashes, exclude_node_ids=excluded),
                    timeout=min(self.timeouts.route_s, _remaining(deadline)), deadline=deadline)
            except grpc.aio.AioRpcError as e:
                if time.monotonic() >= deadline:
                    await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed")
                if refused is not None:  # no other decode node: what the last one said
                    await context.abort(*refused)
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"no route for the request: {e.details()}")
            downstream = engine_pb2.DecodeRequest(request_id=rid, prompt_token_ids=ids,
                                                  sampling=request.sampling, client_request_id=client_id)
            if not route.local_prefill:
                downstream.prefill.CopyFrom(route.prefill)
                downstream.prefill_fallbacks.extend(route.prefill_fallbacks)
            call = self.decode.generate(route.decode.address, downstream, _remaining(deadline))
            detok = IncrementalDetokenizer(self.tokenizer, ids)
            matcher = StopStringMatcher(params.stop)
            num_out = 0
            sent = False
            try:
                async for msg in call:
                    text, stopped = matcher.feed(detok.add(msg.token_ids))
                    reply = gateway_pb2.GenerateResponse(token_ids=msg.token_ids)
                    if num_out == 0:
                        reply.prefill_timing.CopyFrom(msg.prefill_timing)
                    num_out += len(msg.token_ids)
                    sent = True
                    if stopped:
                        reply.text, reply.finish_reason = text, "stop"
                        reply.usage.CopyFrom(msg.usage)
                        reply.usage.prompt_tokens, reply.usage.completion_tokens = len(ids), num_out
                        yield reply
                        return
                    if msg.finish_reason:
                        tail, _ = matcher.feed(detok.flush())
                        reply.text = text + tail + matcher.flush()
                        reply.finish_reason = msg.finish_reason
                        reply.usage.CopyFrom(msg.usage)
                        yield reply
                        return
                    reply.text = text
                    yield reply
                return
            except grpc.aio.AioRpcError as e:
                if (not sent and e.code() in REROUTE and attempt + 1 < MAX_ROUTE_ATTEMPTS
                        and time.monotonic() < deadline):
                    log.warning("decode node %s answered %s for %s (client id %r; %s); routing again",
                                route.decode.node_id, e.code().name, rid, client_id, e.details())
                    refused = (e.code(), f"decode node {route.decode.node_id}: {e.details()}")
                    excluded.append(route.decode.node_id)
                    continue
                code = e.code() if e.code() in PASS_THROUGH else grpc.StatusCode.UNAVAILABLE
                await context.abort(code, f"decode node {route.decode.node_id}: {e.details()}")
            finally:
                call.cancel()

    async def Tokenize(self, request, context):
        try:
            self._check_model(request.model)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return gateway_pb2.TokenizeResponse(
            token_ids=self.tokenizer.encode(request.text, add_special_tokens=request.add_special_tokens))

    async def ListModels(self, request, context):
        return gateway_pb2.ListModelsResponse(models=[gateway_pb2.ModelInfo(
            id=self.model_id, max_model_len=self.max_model_len, vocab_size=self.vocab_size)])

    async def close(self) -> None:
        await self.meta.close()
        await self.decode.close()


def _remaining(deadline: float) -> float:
    """Seconds left until deadline; a tiny positive value once it passed (the call then
    fails DEADLINE_EXCEEDED at once)."""
    return max(deadline - time.monotonic(), 1e-3)
