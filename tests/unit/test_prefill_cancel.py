"""The real PrefillServicer over in-process gRPC: a unary CancelPrefill that lands while
the prefill is still queued ends the Prefill call CANCELLED (not as a finished prefill:
no first token read from an aborted output, no kv-store put of freed blocks), and every
block is free afterwards. The engine's step thread is held by a gate so that the order
(add, then abort) is exact."""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import grpc
import torch

from common.engine import AsyncEngine
from common.engine.llm_engine import LLMEngine
from common.config import EngineConfig, NodeConfig, TimeoutConfig, TransferConfig
from common.transfer.fake import FakeTransfer
from common.transfer.kv_writes import KVSender
from common.kv_layout import KVLayout
from protos.pdmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from services.node.members_view import MembersView
from services.node.metrics import NodeMetrics
from services.prefill.servicer import PrefillServicer
from tests.channels import operator_channel


def test_unary_cancel_of_a_queued_prefill_ends_it_cancelled(tiny_model):
    engine = LLMEngine(EngineConfig(str(tiny_model("llama")), num_blocks=64, max_model_len=256))
    layout = KVLayout.of_tensor(engine.kv_cache)
    src, dst = FakeTransfer(), FakeTransfer()
    src.register(engine.kv_cache.data_ptr(), engine.kv_cache.numel() * engine.kv_cache.element_size())
    dest_kv = torch.zeros_like(engine.kv_cache)
    dst.register(dest_kv.data_ptr(), dest_kv.numel() * dest_kv.element_size())
    node = SimpleNamespace(engine=AsyncEngine(engine), sender=KVSender(src, layout),
                           executor=ThreadPoolExecutor(2), kv_store=None, layout=layout,
                           rank_layouts=[layout], rank_writers=None, staging=None,
                           node=NodeConfig("prefill", "prefill-0"), mesh=SimpleNamespace(timeouts=TimeoutConfig(), transfer=TransferConfig(backend="fake")))
    node.metrics = NodeMetrics("prefill-0", node.engine.snapshot, src)
    decode_0 = common_pb2.NodeInfo(node_id="decode-0", role="decode", transfer_endpoint=dst.endpoint,
                                   kv_layout=KVLayout.of_tensor(dest_kv).to_proto())
    servicer = PrefillServicer(node, MembersView.static([decode_0]))
    prompt = list(range(3, 67))

    async def scenario():
        server = grpc.aio.server()
        engine_pb2_grpc.add_PrefillServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        gate, held = threading.Event(), threading.Event()
        node.engine._submit(lambda: (held.set(), gate.wait(10)))
        assert await asyncio.to_thread(held.wait, 10)
        try:
            async with operator_channel(f"127.0.0.1:{port}") as channel:
                stub = engine_pb2_grpc.PrefillStub(channel)
                dest = engine_pb2.KVDestination(
                    node_id="decode-0", transfer_endpoint=dst.endpoint,
                    layout=KVLayout.of_tensor(dest_kv).to_proto(), block_ids=list(range(4)))
                call = asyncio.ensure_future(stub.Prefill(engine_pb2.PrefillRequest(
                    request_id="r", prompt_token_ids=prompt, destination=dest,
                    sampling=common_pb2.SamplingParams(max_tokens=1)), timeout=10))
                while "r" not in servicer.inflight:
                    await asyncio.sleep(0.01)
                cancel = asyncio.ensure_future(stub.CancelPrefill(
                    engine_pb2.CancelPrefillRequest(request_id="r"), timeout=10))
                await asyncio.sleep(0.1)          # the abort is queued behind the add
                gate.set()
                assert (await cancel).was_running
                try:
                    await call
                    raise AssertionError("Prefill answered a cancelled request")
                except grpc.aio.AioRpcError as e:
                    assert e.code() == grpc.StatusCode.CANCELLED, e
            while servicer._releases:
                await asyncio.wait(list(servicer._releases))
            return (await node.engine.stats())["used_blocks"]
        finally:
            gate.set()
            await server.stop(None)

    try:
        assert asyncio.run(scenario()) == 0
        assert dst.num_writes == 0
    finally:
        node.engine.shutdown()
        node.executor.shutdown()
        src.close()
        dst.close()
