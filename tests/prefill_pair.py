"""A decode engine and a real PrefillServicer in one process, over real gRPC on
127.0.0.1 and the fake transfer (so a test can hold KV writes in flight, let them land
late, or drop them as a dead process's): the decode side drives the real RemotePrefill.
No meta-server: the prefill node checks destinations against `members`, which lists the
decode node as it would register (pair.members may be changed by a test)."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import grpc

from common.config import EngineConfig, NodeConfig, TimeoutConfig, TransferConfig
from common.engine import AsyncEngine, SamplingParams
from common.engine.llm_engine import LLMEngine
from common.transfer.fake import FakeTransfer
from common.transfer.kv_writes import KVSender
from common.kv_layout import KVLayout
from protos.pdmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from services.decode.remote_prefill import RemotePrefill
from services.node import grpc_util
from services.node.members_view import MembersView
from services.node.metrics import NodeMetrics
from services.prefill.servicer import PrefillServicer
from tests.channels import operator_channel

FAST = TimeoutConfig(transfer_s=0.3, cancel_ack_s=1.0, prefill_s=10.0, request_s=60.0,
                     kv_store_pin_lease_s=5.0, kv_store_reserve_lease_s=5.0)


def _engine(model, num_blocks: int, **engine_args) -> LLMEngine:
    block_size = engine_args.get("block_size", 16)
    return LLMEngine(EngineConfig(str(model), num_blocks=num_blocks,
                                  max_model_len=min(max(256, block_size), block_size * num_blocks), **engine_args))


def _registered(engine: LLMEngine) -> tuple[FakeTransfer, KVLayout]:
    transfer = FakeTransfer()
    kv = engine.kv_cache
    transfer.register(kv.data_ptr(), kv.numel() * kv.element_size())
    return transfer, KVLayout.of_cache(kv, engine.kv_scales_id)


class PrefillPair:
    """engine_args: for both engines' EngineConfig (e.g. kernel_backend, block_size)."""

    def __init__(self, model, decode_blocks: int = 64, prefill_blocks: int = 64, max_queue: int = 256,
                 timeouts: TimeoutConfig = FAST, kv_push: str = "layerwise", **engine_args):
        self.timeouts = timeouts
        self.decode_engine = _engine(model, decode_blocks, **engine_args)
        self.prefill_engine = _engine(model, prefill_blocks, **engine_args)
        self.decode_transfer, decode_layout = _registered(self.decode_engine)
        self.prefill_transfer, prefill_layout = _registered(self.prefill_engine)
        mesh = SimpleNamespace(timeouts=timeouts, transfer=TransferConfig(backend="fake", kv_push=kv_push))
        self.prefill_node = SimpleNamespace(
            engine=AsyncEngine(self.prefill_engine), sender=KVSender(self.prefill_transfer, prefill_layout),
            executor=ThreadPoolExecutor(4), kv_store=None, layout=prefill_layout,
            rank_layouts=[prefill_layout], rank_writers=None, staging=None,
            node=NodeConfig("prefill", "prefill-0", max_queue=max_queue), mesh=mesh)
        self.prefill_node.metrics = NodeMetrics("prefill-0", self.prefill_node.engine.snapshot, self.prefill_transfer)
        self.members = [common_pb2.NodeInfo(node_id="decode-0", role="decode", transfer_backend="fake",
                                            transfer_endpoint=self.decode_transfer.endpoint,
                                            kv_layout=decode_layout.to_proto())]
        self.servicer = PrefillServicer(self.prefill_node, MembersView.static(self.members))
        self.decode = AsyncEngine(self.decode_engine)
        self.decode_node = SimpleNamespace(
            engine=self.decode, transfer=self.decode_transfer, layout=decode_layout, mesh=mesh,
            node=NodeConfig("decode", "decode-0"), channel=self._channel,
            peer_limits=grpc_util.PeerLimits(grpc_util.MAX_CALLS_PER_PEER))
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.server = None
        self.address = ""

    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = operator_channel(address)
        return self._channels[address]

    async def start(self) -> "PrefillPair":
        self.server = grpc.aio.server()
        engine_pb2_grpc.add_PrefillServicer_to_server(self.servicer, self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        await self.server.start()
        return self

    async def kill_prefill(self) -> None:
        """The prefill node dies: its server goes (its port refuses connections), its
        writes in flight never land."""
        await self.server.stop(None)
        self.prefill_transfer.close()

    def remote(self, rid: str, prompt: list[int], params: SamplingParams, deadline_s: float = 30.0,
               fallbacks: int = 0) -> RemotePrefill:
        info = common_pb2.NodeInfo(node_id="prefill-0", role="prefill", address=self.address)
        sampling = common_pb2.SamplingParams(max_tokens=params.max_tokens, temperature=params.temperature,
                                             ignore_eos=params.ignore_eos)
        if params.logprobs is not None:
            sampling.logprobs = params.logprobs
        request = engine_pb2.DecodeRequest(
            request_id=rid, prompt_token_ids=prompt, prefill=info, prefill_fallbacks=[info] * fallbacks,
            sampling=sampling)
        return RemotePrefill(self.decode_node, request, time.monotonic() + deadline_s)

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        if self.server is not None:
            await self.server.stop(None)
        self.decode.shutdown()
        self.prefill_node.engine.shutdown()
        self.prefill_node.executor.shutdown(wait=False, cancel_futures=True)
        self.prefill_transfer.close()
        self.decode_transfer.close()
