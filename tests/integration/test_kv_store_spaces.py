"""The kv-store makes key spaces only for models (x layouts) that live members serve, so
bogus models cannot fill kv_store.max_spaces and lock the real one out. One process: a
real meta-server and a real kv-store server (services/kv_store/server.create_server) on
127.0.0.1 port 0, a client with its own KV cache on Mooncake over TCP, and members
registered with the meta-server as nodes do."""
from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from common.config import KVStoreConfig, MeshConfig, MetaConfig, TimeoutConfig, TransferConfig
from common.hashing import hash_block_chain, layout_key
from common.transfer import create_transfer
from common.transfer.kv_writes import KVSender
from common.kv_layout import KVLayout
from protos.pdmesh.v1 import common_pb2, kv_store_pb2 as pb, kv_store_pb2_grpc, meta_pb2, meta_pb2_grpc
from services.kv_store.server import create_server as create_store
from services.kv_store.server import stop_server
from services.meta_server.server import create_server as create_meta
from tests.channels import operator_channel


def _mooncake_importable() -> bool:
    try:
        import mooncake.engine  # noqa: F401
    except ImportError:
        return False
    return True


pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not _mooncake_importable(), reason="mooncake.engine cannot be imported")]
BS, LAYERS, HEADS, DIM, BLOCKS = 16, 2, 2, 16, 16
SLOT_BYTES = LAYERS * 2 * BS * HEADS * DIM * 4
NUM_SLOTS = 8                                     # per key space


class Cache:
    """A client's KV cache on Mooncake, random contents."""

    def __init__(self, model_id: str, dtype=torch.float32):
        self.kv = torch.randn(LAYERS, 2, BLOCKS, BS, HEADS, DIM, generator=torch.Generator().manual_seed(7)).to(dtype)
        self.transfer = create_transfer("mooncake", hostname="127.0.0.1")
        self.transfer.register(self.kv.data_ptr(), self.kv.numel() * self.kv.element_size())
        self.layout = KVLayout.of_tensor(self.kv)
        self.sender = KVSender(self.transfer, self.layout)
        self.space = pb.KeySpace(model_id=model_id, layout=self.layout.to_proto())
        self.model_id = model_id

    def chain(self, tokens):
        return hash_block_chain(tokens, BS, self.model_id, layout_key(self.layout))

    def close(self):
        self.transfer.close()


def tokens(start: int, blocks: int = 1) -> list[int]:
    return list(range(start, start + blocks * BS))


class Mesh:
    async def start(self) -> "Mesh":
        self.meta, meta_port = await create_meta(MetaConfig(port=0, ttl_seconds=60.0))
        mesh = MeshConfig(model="unused", meta=MetaConfig(port=meta_port, ttl_seconds=60.0),
                          transfer=TransferConfig(backend="mooncake"),
                          kv_store=KVStoreConfig(port=0, capacity_mb=NUM_SLOTS * SLOT_BYTES / (1 << 20), max_spaces=4,
                                                 high_watermark=1.0, low_watermark=0.5),
                          timeouts=TimeoutConfig(transfer_s=1.0))
        self.server, port = await create_store(mesh, 0)
        self.meta_channel = operator_channel(f"127.0.0.1:{meta_port}")
        self.channel = operator_channel(f"127.0.0.1:{port}")
        self.stub = kv_store_pb2_grpc.KVStoreStub(self.channel)
        return self

    async def register(self, node_id: str, model_id: str, layout: KVLayout, role: str = "prefill") -> None:
        info = common_pb2.NodeInfo(node_id=node_id, role=role, address="127.0.0.1:1", model_id=model_id,
                                   kv_layout=layout.to_proto())
        await meta_pb2_grpc.MetaServerStub(self.meta_channel).Register(
            meta_pb2.RegisterRequest(node=info, instance_id=node_id), timeout=5)

    async def put(self, cache: Cache, toks: list[int], block_ids: list[int]) -> pb.ReservePutResponse:
        reply = await self.stub.ReservePut(pb.ReservePutRequest(space=cache.space, block_hashes=cache.chain(toks),
                                                                token_ids=toks), timeout=5)
        if reply.put_id:
            await asyncio.to_thread(cache.sender.send_blocks, reply.region.transfer_endpoint,
                                    KVLayout.from_proto(reply.region.layout),
                                    [block_ids[i] for i in reply.indices], list(reply.slot_ids))
            await self.stub.CommitPut(pb.CommitPutRequest(put_id=reply.put_id), timeout=5)
        return reply

    async def get(self, cache: Cache, toks: list[int], block_ids: list[int]) -> int:
        """Blocks read back into block_ids (the leading hits)."""
        reply = await self.stub.PinGet(pb.PinGetRequest(space=cache.space, block_hashes=cache.chain(toks),
                                                        token_ids=toks), timeout=5)
        if reply.slot_ids:
            await asyncio.to_thread(cache.sender.fetch_blocks, reply.region.transfer_endpoint,
                                    KVLayout.from_proto(reply.region.layout), list(reply.slot_ids),
                                    block_ids[:len(reply.slot_ids)])
            await self.stub.Release(pb.ReleaseRequest(pin_id=reply.pin_id), timeout=5)
        return len(reply.slot_ids)

    async def code(self, call) -> grpc.StatusCode:
        try:
            await call
        except grpc.aio.AioRpcError as e:
            self.last_details = e.details()
            return e.code()
        return grpc.StatusCode.OK

    async def num_spaces(self) -> int:
        return (await self.stub.Stats(pb.StatsRequest(), timeout=5)).num_spaces

    async def close(self) -> None:
        await self.channel.close()
        await self.meta_channel.close()
        await stop_server(self.server, 0.5)
        await self.meta.stop(None)
        await self.meta.close_extras()


def test_bogus_key_spaces_are_refused_and_the_served_model_keeps_its_cache():
    async def scenario():
        mesh = await Mesh().start()
        real = Cache("real-model")
        half = Cache("real-model", dtype=torch.float16)      # the served model, a layout nobody serves
        bogus = [Cache(f"bogus-{i}") for i in range(5)]
        try:
            await mesh.register("prefill-0", "real-model", real.layout)
            for cache in [*bogus, half]:
                code = await mesh.code(mesh.put(cache, tokens(100), [0]))
                assert code == grpc.StatusCode.PERMISSION_DENIED, (cache.model_id, code)
                assert repr(cache.model_id) in mesh.last_details and "no live node" in mesh.last_details
            assert await mesh.num_spaces() == 0
            # the served model's puts and gets work: reserve -> write -> commit, pin -> read
            for i in range(3):
                reply = await mesh.put(real, tokens(1000 * (i + 1), 2), [2 * i, 2 * i + 1])
                assert reply.put_id and len(reply.slot_ids) == 2
            assert await mesh.get(real, tokens(2000, 2), [10, 11]) == 2
            assert torch.equal(real.kv[:, :, 10:12], real.kv[:, :, 2:4])
            assert await mesh.num_spaces() == 1
        finally:
            for cache in [real, half, *bogus]:
                cache.close()
            await mesh.close()
    asyncio.run(scenario())


def test_a_model_served_from_now_on_gets_its_space_at_once_with_its_own_quota():
    async def scenario():
        mesh = await Mesh().start()
        a, b = Cache("model-a"), Cache("model-b")
        try:
            await mesh.register("prefill-a", "model-a", a.layout)
            assert (await mesh.put(a, tokens(0, 4), [0, 1, 2, 3])).put_id
            assert await mesh.code(mesh.put(b, tokens(0), [0])) == grpc.StatusCode.PERMISSION_DENIED
            await mesh.register("decode-b", "model-b", b.layout, role="decode")   # just registered
            assert (await mesh.put(b, tokens(0), [0])).put_id                     # no wait for the cache
            # model-b fills its own pool (NUM_SLOTS) and evicts only its own blocks
            for i in range(3):
                await mesh.put(b, tokens(5000 + 1000 * i, 4), [4, 5, 6, 7])
            stats = await mesh.stub.Stats(pb.StatsRequest(), timeout=5)
            assert stats.num_spaces == 2 and stats.evictions > 0
            assert await mesh.get(a, tokens(0, 4), [8, 9, 10, 11]) == 4
            assert torch.equal(a.kv[:, :, 8:12], a.kv[:, :, 0:4])
        finally:
            a.close()
            b.close()
            await mesh.close()
    asyncio.run(scenario())
