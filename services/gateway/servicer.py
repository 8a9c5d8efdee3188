"""Gateway servicer: the public pdmesh.v1.Gateway API.

Generate: validate + tokenize (INVALID_ARGUMENT naming the field), then one
RequestStream (services/gateway/request_stream.py: routing, the decode stream,
detokenization and stop strings, rerouting and migration to another decode node when the
one serving the request dies). Client cancel: the decode call is cancelled, which aborts
the request downstream.
"""
from __future__ import annotations

import logging
import time

import grpc

from common.config import TimeoutConfig
from common.hashing import hash_block_chain, layout_key
from common.model.tokenizer import Tokenizer
from protos.pdmesh.v1 import gateway_pb2, gateway_pb2_grpc, meta_pb2
from services.gateway.decode_client import DecodeClient
from services.gateway.request_stream import GatewayAbort, RequestStream
from services.gateway.meta_client import MetaClient
from common.engine.validation import validate_request
from services.convert import sampling_from_proto

log = logging.getLogger("pdmesh.gateway")


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, tokenizer: Tokenizer, model_id: str, vocab_size: int, max_model_len: int,
                 meta_addresses: list[str] | str, timeouts: TimeoutConfig = TimeoutConfig(),
                 max_migrations: int = 3):
        self.tokenizer, self.model_id = tokenizer, model_id
        self.vocab_size, self.max_model_len = vocab_size, max_model_len
        if isinstance(meta_addresses, str):
            meta_addresses = [meta_addresses]
        self.timeouts, self.max_migrations = timeouts, max_migrations
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
        stream = RequestStream(meta=self.meta, decode=self.decode, timeouts=self.timeouts,
                               max_migrations=self.max_migrations, model_id=self.model_id,
                               tokenizer=self.tokenizer, prompt_ids=ids, params=params, request=request,
                               deadline=self._deadline(context), block_hashes=self._block_hashes)
        try:
            async for reply in stream.replies():
                yield reply
        except GatewayAbort as e:
            await context.abort(e.code, e.details)

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

