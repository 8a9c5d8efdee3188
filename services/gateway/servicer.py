"""Gateway servicer: the public pdmesh.v1.Gateway API.

Generate, in order, each step refusing with INVALID_ARGUMENT naming the field:
  parse (services/gateway/wire.py: invalid UTF-8 names the field) -> bounds
  (limits.*, before any work: services/gateway/request_limits.py) -> model -> sampling
  -> tokenize a text prompt in the tokenizer pool (off the event loop) -> the prompt
  against the vocabulary and max_model_len
then one RequestStream (services/gateway/request_stream.py: routing, the decode stream,
detokenization and stop strings, rerouting and migration to another decode node when the
one serving the request dies). Client cancel: the decode call is cancelled, which aborts
the request downstream. Tokenize: parse -> bounds -> model -> the tokenizer pool.
The OpenAI-compatible HTTP API (services/gateway/openai_http) builds a GenerateRequest
and goes through the same open_stream -> replies.

Every error a client gets is fit for a public client (services/gateway/public_errors.py):
the mesh's failures and the gateway's own bugs come as a plain sentence and an error id,
what happened inside goes to the log under that id.
"""
from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

import grpc

from common.timeline import mark
from common.config import LimitsConfig, TimeoutConfig
from common.engine.sampling_params import SamplingParams
from common.engine.validation import validate_length, validate_request, validate_sampling
from common.hashing import hash_block_chain, layout_key
from common.model.tokenizer import Tokenizer
from protos.pdmesh.v1 import gateway_pb2, gateway_pb2_grpc, meta_pb2
from services.convert import sampling_from_proto
from services.gateway import public_errors
from services.gateway.decode_client import DecodeClient
from services.gateway.load_report import LoadReporter
from services.gateway.metrics import GatewayMetrics
from services.gateway.meta_client import MetaClient
from services.gateway.public_errors import PublicError
from services.gateway.request_limits import check_generate, check_tokenize
from services.gateway.request_stream import RequestStream
from services.gateway.tokenizer_pool import TokenizerBusy, TokenizerPool
from services.gateway.wire import BadRequest

log = logging.getLogger("pdmesh.gateway")
MAX_MODEL_CHARS = 256


class UnknownModel(ValueError):
    """The request names a model this mesh does not serve."""


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """Register with services.gateway.wire.add_gateway_to_server (invalid UTF-8 is then
    INVALID_ARGUMENT); close() when the server stopped. membership_ttl_s: the mesh's
    meta_server.ttl_seconds (how long a request keeps off a node it failed on).
    report_every_s > 0: every request that ended is reported to the meta-server's planner
    that often (services/gateway/load_report.py; self.load_report); 0 = never."""

    def __init__(self, tokenizer: Tokenizer, model_id: str, vocab_size: int, max_model_len: int,
                 meta_addresses: list[str] | str, timeouts: TimeoutConfig = TimeoutConfig(),
                 max_migrations: int = 3, limits: LimitsConfig = LimitsConfig(), membership_ttl_s: float = 5.0,
                 report_every_s: float = 0.0):
        self.tokenizer, self.model_id = tokenizer, model_id
        self.vocab_size, self.max_model_len = vocab_size, max_model_len
        if isinstance(meta_addresses, str):
            meta_addresses = [meta_addresses]
        self.timeouts, self.max_migrations, self.limits = timeouts, max_migrations, limits
        self.membership_ttl_s = membership_ttl_s
        self.meta = MetaClient(meta_addresses, timeouts.meta_follow_s)
        self.decode = DecodeClient()
        self.tokenizer_pool = TokenizerPool(tokenizer, limits.tokenizer_threads)
        self._hash_args: tuple[int, str, str] | None = None   # block_size, model_id, layout
        self.metrics = GatewayMetrics()   # every request that passed validation (services/gateway/metrics.py)
        self.load_report = (LoadReporter(self.meta, report_every_s, timeouts.load_report_s)
                            if report_every_s > 0 else None)

    async def _block_hashes(self, ids: list[int], deadline: float | None = None) -> list[bytes]:
        """The prompt's block hash chain as the nodes compute it (for cache-aware routing);
        block size and layout come from the first live node of our model; [] if none yet.
        deadline: time.monotonic() the meta-server is asked until, at most."""
        if self._hash_args is None:
            try:
                members = await self.meta.call("ListMembers", meta_pb2.ListMembersRequest(),
                                               timeout=self.timeouts.route_s, deadline=deadline)
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

    def check_model(self, model: str) -> None:
        """ValueError naming `model` unless it is "" or this mesh's model id (UnknownModel
        when it is a well-formed id of another model)."""
        if len(model) > MAX_MODEL_CHARS:
            raise ValueError(f"model is {len(model)} characters; a model id is at most {MAX_MODEL_CHARS}")
        if model and model != self.model_id:
            raise UnknownModel(f"model {public_errors.echo(model)} is not served here; "
                               f"available: [{self.model_id!r}]")

    async def _validated(self, request: gateway_pb2.GenerateRequest) -> tuple[list[int], SamplingParams]:
        """The prompt's ids and the sampling parameters; ValueError naming the field."""
        check_generate(request, self.limits)
        self.check_model(request.model)
        params = sampling_from_proto(request.sampling)
        validate_sampling(params, self.vocab_size)
        which = request.WhichOneof("input")
        if which == "prompt":
            if not request.prompt:
                raise ValueError("prompt must not be empty")
            ids = await self.tokenizer_pool.encode(request.prompt)
        elif which == "prompt_token_ids":
            validate_length(len(request.prompt_token_ids.ids), params, self.max_model_len)
            ids = list(request.prompt_token_ids.ids)
        else:
            raise ValueError("one of prompt or prompt_token_ids is required")
        validate_request(ids, params, self.vocab_size, self.max_model_len)
        return ids, params

    async def open_stream(self, request: gateway_pb2.GenerateRequest, deadline: float) -> RequestStream:
        """The request validated, as a RequestStream that has sent nothing yet (deadline:
        time.monotonic). Raises PublicError: INVALID_ARGUMENT naming the field (reason
        UNKNOWN_MODEL for a model not served here), RESOURCE_EXHAUSTED when the tokenizer
        pool is full, INTERNAL. Shared by Generate and the HTTP API."""
        arrival = time.perf_counter()
        try:
            ids, params = await self._validated(request)
        except ValueError as e:
            reason = public_errors.UNKNOWN_MODEL if isinstance(e, UnknownModel) else ""
            raise PublicError(grpc.StatusCode.INVALID_ARGUMENT, str(e), reason) from None
        except TokenizerBusy as e:
            raise PublicError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from None
        except Exception:
            raise public_errors.internal_error("Generate", request.request_id) from None
        return RequestStream(meta=self.meta, decode=self.decode, timeouts=self.timeouts,
                             max_migrations=self.max_migrations, model_id=self.model_id,
                             tokenizer=self.tokenizer, prompt_ids=ids, params=params, request=request,
                             deadline=deadline, block_hashes=self._block_hashes,
                             metrics=self.metrics, arrival=arrival, exclusion_lapse_s=self.membership_ttl_s,
                             load_report=self.load_report)

    async def replies(self, stream: RequestStream) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        """stream's replies; every failure as PublicError. Closing this iterator (or
        cancelling its reader) cancels the request downstream."""
        try:
            async with aclosing(stream.replies()) as replies:
                async for reply in replies:
                    yield reply
        except PublicError:
            raise
        except grpc.aio.AioRpcError as e:   # a mesh call the stream does not handle itself
            raise public_errors.mesh_error(grpc.StatusCode.UNAVAILABLE, public_errors.NODE_FAILED,
                                           f"{e.code().name} {e.details()}", stream.request.request_id) from None
        except Exception:
            raise public_errors.internal_error("Generate", stream.request.request_id) from None

    def deadline(self, client_remaining_s: float | None = None) -> float:
        """A request's deadline (time.monotonic): request_s, or the client's if sooner."""
        remaining = self.timeouts.request_s
        if client_remaining_s is not None:
            remaining = min(remaining, client_remaining_s)
        return time.monotonic() + remaining

    async def Generate(self, request, context):
        if isinstance(request, BadRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        mark("gateway.in", request.request_id)
        try:
            stream = await self.open_stream(request, self.deadline(context.time_remaining()))
        except PublicError as e:
            await _abort(context, e)
        first = True
        try:
            async with aclosing(self.replies(stream)) as replies:
                async for reply in replies:
                    if first and reply.token_ids:
                        first = False
                        mark("gateway.first_out", request.request_id)
                    yield reply
        except PublicError as e:
            await _abort(context, e)

    async def Tokenize(self, request, context):
        if isinstance(request, BadRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        try:
            check_tokenize(request, self.limits)
            self.check_model(request.model)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            ids = await self.tokenizer_pool.encode(request.text, request.add_special_tokens)
        except TokenizerBusy as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except Exception:
            await _abort(context, public_errors.internal_error("Tokenize"))
        return gateway_pb2.TokenizeResponse(token_ids=ids)

    async def ListModels(self, request, context):
        if isinstance(request, BadRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return gateway_pb2.ListModelsResponse(models=[gateway_pb2.ModelInfo(
            id=self.model_id, max_model_len=self.max_model_len, vocab_size=self.vocab_size)])

    async def close(self) -> None:
        if self.load_report is not None:
            await self.load_report.close()
        await self.meta.close()
        await self.decode.close()
        self.tokenizer_pool.close()


async def _abort(context, error: PublicError) -> None:
    await context.abort(error.code, error.details)
