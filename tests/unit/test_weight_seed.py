"""A weight seed's leases (services/node/weight_seed.py) over real gRPC, and a loader's
reads (services/node/weight_loader.PeerWeights.pull) over the fake transfer backend with
its fault injection: when the weights are registered, and what a failed read leaves."""
from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from common.config import MeshConfig
from common.model.config import load_model_config
from common.model.registry import build_model
from common.model.weight_pool import WeightPool
from common.parallel.shard import plan_shard
from common.runner.weight_source import DiskWeights
from common.transfer.base import TransferError
from common.transfer.fake import FakeTransfer
from kernels import get_backend
from protos.pdmesh.v1 import weights_pb2, weights_pb2_grpc
from services.node import weight_loader
from services.node.weight_loader import PeerLoadError, PeerWeights
from services.node.weight_seed import RankPool, WeightSeedService

IDENTITY = "ab" * 16
LEASE_S = 30.0


def model_of(model_dir, load: bool):
    mcfg = load_model_config(model_dir)
    model = build_model(mcfg, get_backend("ref", torch.device("cpu")), torch.float32, max_positions=256,
                        shard=plan_shard(mcfg, 1, 0, False))
    if load:
        model.load_weights(model_dir)
    return model


@pytest.fixture
def seed_pool(tiny_model):
    return WeightPool.of_model(model_of(tiny_model("llama"), True), bucket_bytes=1 << 16)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def serve(service: WeightSeedService):
    server = grpc.aio.server()
    weights_pb2_grpc.add_WeightSeedServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, grpc.aio.insecure_channel(f"127.0.0.1:{port}")


def test_leases_register_the_weights_only_while_held_and_lapse(seed_pool):
    transfer, clock = FakeTransfer(), Clock()
    service = WeightSeedService("seed-0", IDENTITY, [RankPool(0, transfer, seed_pool)], max_clients=2,
                                lease_s=LEASE_S, clock=clock)
    def ask(loader: str) -> weights_pb2.OpenWeightsRequest:
        return weights_pb2.OpenWeightsRequest(identity=IDENTITY, tensor_parallel_size=1, loader_node_id=loader)

    async def run():
        server, channel = await serve(service)
        stub = weights_pb2_grpc.WeightSeedStub(channel)
        registered = lambda: transfer.contains(seed_pool.address, seed_pool.nbytes)   # noqa: E731
        try:
            assert not registered()
            for wrong in (weights_pb2.OpenWeightsRequest(identity="cd" * 16, tensor_parallel_size=1),
                          weights_pb2.OpenWeightsRequest(identity=IDENTITY, tensor_parallel_size=2)):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.OpenWeights(wrong)
                assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and not registered()
            first = await stub.OpenWeights(ask("n1"))
            assert registered() and first.lease_s == LEASE_S
            rank = first.ranks[0]
            assert (rank.transfer_endpoint, rank.base_address) == (transfer.endpoint, seed_pool.address)
            assert rank.manifest == seed_pool.manifest.to_proto()
            second = await stub.OpenWeights(ask("n2"))
            with pytest.raises(grpc.aio.AioRpcError) as e:          # a third loader
                await stub.OpenWeights(ask("n3"))
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            rank1 = await stub.OpenWeights(ask("n1"))               # another rank of a loader admitted
            await stub.CloseWeights(weights_pb2.WeightLease(lease_id=rank1.lease_id))
            await stub.CloseWeights(weights_pb2.WeightLease(lease_id=first.lease_id))
            assert registered()                               # the second lease still holds them
            clock.now += LEASE_S - 1
            await stub.RenewWeights(weights_pb2.WeightLease(lease_id=second.lease_id))
            clock.now += LEASE_S - 1                          # renewed: still held
            await stub.RenewWeights(weights_pb2.WeightLease(lease_id=second.lease_id))
            clock.now += LEASE_S + 1                          # lapsed
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.RenewWeights(weights_pb2.WeightLease(lease_id=second.lease_id))
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
            assert not registered() and service.leases == {} and service.leases_granted == 3
        finally:
            await channel.close()
            await server.stop(None)
            await service.close()

    asyncio.run(run())


def loader(transfer) -> PeerWeights:
    return PeerWeights(MeshConfig(model="unused"), "loader-0", transfer, DiskWeights("unused"), strict=True)


def test_a_loader_reads_every_bucket_then_checks_them_with_its_buffer_unregistered(tiny_model, seed_pool):
    seed_transfer, transfer = FakeTransfer(), FakeTransfer()
    seed_transfer.register(seed_pool.address, seed_pool.nbytes)
    model = model_of(tiny_model("llama"), False)
    pool = WeightPool.for_manifest(model, seed_pool.manifest)
    loader(transfer).pull(pool, seed_transfer.endpoint, seed_pool.address)
    assert torch.equal(pool.buffer[:seed_pool.nbytes], seed_pool.buffer[:seed_pool.nbytes])
    assert transfer.num_reads == seed_pool.manifest.num_buckets and not transfer.contains(pool.address, 1)

    seed_pool.buffer[(1 << 16) * 2 + 7] ^= 0x10            # bucket 2 differs from its checksum
    with pytest.raises(PeerLoadError, match=r"checksum mismatch in bucket\(s\) \[2\] of"):
        loader(transfer).pull(WeightPool.for_manifest(model, seed_pool.manifest), seed_transfer.endpoint,
                              seed_pool.address)
    seed_pool.buffer[(1 << 16) * 2 + 7] ^= 0x10


def test_a_failed_read_unregisters_the_buffer_and_an_unsettled_one_keeps_it(tiny_model, seed_pool):
    seed_transfer, transfer = FakeTransfer(), FakeTransfer()
    seed_transfer.register(seed_pool.address, seed_pool.nbytes)
    model = model_of(tiny_model("llama"), False)
    settled = WeightPool.for_manifest(model, seed_pool.manifest)
    transfer.fail_next(1, TransferError("the seed went away"))
    with pytest.raises(TransferError, match="went away"):
        loader(transfer).pull(settled, seed_transfer.endpoint, seed_pool.address)
    assert not transfer.contains(settled.address, 1)

    unsettled = WeightPool.for_manifest(model, seed_pool.manifest)
    transfer.fail_next(1, TransferError("timed out with ranges in flight", unsettled=True))
    before = len(weight_loader._QUARANTINED)
    with pytest.raises(TransferError, match="in flight"):
        loader(transfer).pull(unsettled, seed_transfer.endpoint, seed_pool.address)
    assert transfer.contains(unsettled.address, unsettled.nbytes)     # late bytes land in memory kept aside
    assert len(weight_loader._QUARANTINED) == before + 1 and weight_loader._QUARANTINED[-1][0] is unsettled
