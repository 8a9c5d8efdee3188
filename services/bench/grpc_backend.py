"""The grpc backend: a pdmesh gateway's Generate stream (services/bench/base.py's timing).

    GrpcBackend(address, model="", api_key_file="", tls_dir="")

Credentials as for `pdmesh generate` (services/security/client_creds.py: the running
mesh's only for its own addresses). model "" is the mesh's. An RPC that fails is a result
with its status code name as the error.
"""
from __future__ import annotations

import time
import uuid

import grpc

from common import timeline
from protos.pdmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.bench.base import Backend, ModelInfo
from services.bench.datasets import BenchRequest
from services.bench.metrics import RequestResult


def _message(req: BenchRequest, model: str) -> gateway_pb2.GenerateRequest:
    msg = gateway_pb2.GenerateRequest(model=model, sampling=common_pb2.SamplingParams(
        max_tokens=req.max_tokens, temperature=0.0, ignore_eos=req.ignore_eos))
    if req.prompt_token_ids:
        msg.prompt_token_ids.ids.extend(req.prompt_token_ids)
    else:
        msg.prompt = req.prompt
    return msg


class GrpcBackend(Backend):
    name = "grpc"

    def __init__(self, address: str, model: str = "", api_key_file: str = "", tls_dir: str = "",
                 timeout_s: float = 600.0):
        from services.security.client_auth import client_channel
        from services.security.client_creds import api_key, client_tls
        self.address, self.model, self.timeout_s = address, model, timeout_s
        self._channel = client_channel(address, bearer=api_key(api_key_file, address=address),
                                       tls=client_tls(tls_dir, address=address))
        self._stub = gateway_pb2_grpc.GatewayStub(self._channel)

    async def model_info(self) -> ModelInfo:
        models = await self._stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=30)
        info = next((m for m in models.models if not self.model or m.id == self.model), None)
        if info is None:
            served = ", ".join(m.id for m in models.models) or "none"
            raise ValueError(f"model {self.model!r} is not served at {self.address}; served: {served}")
        return ModelInfo(info.id, info.vocab_size, info.max_model_len)

    async def one_request(self, req: BenchRequest) -> RequestResult:
        result = RequestResult(num_prompt_tokens=req.num_prompt_tokens)
        message = _message(req, self.model)
        message.request_id = uuid.uuid4().hex   # the key of its timeline (common/timeline.py)
        start = time.perf_counter()
        timeline.mark("client.sent", message.request_id)
        last = None
        try:
            async for msg in self._stub.Generate(message, timeout=self.timeout_s):
                now = time.perf_counter()
                if msg.HasField("prefill_timing") and msg.prefill_timing.remote:
                    t = msg.prefill_timing
                    result.remote_prefill_s = (t.queue_ms + t.compute_ms + t.transfer_ms) / 1e3
                if msg.token_ids:
                    if last is None:
                        result.ttft_s = now - start
                        timeline.mark("client.first", message.request_id)
                    else:
                        result.itl_s.append(now - last)
                    last = now
                    result.num_output_tokens += len(msg.token_ids)
                    result.output_token_ids.extend(msg.token_ids)
                if msg.finish_reason:
                    result.num_prompt_tokens = msg.usage.prompt_tokens or result.num_prompt_tokens
            result.e2e_s = time.perf_counter() - start
        except grpc.aio.AioRpcError as e:
            result.error = e.code().name
        return result

    async def close(self) -> None:
        await self._channel.close()
