"""The kv-store as a process (`pdmesh serve kv-store`), driven over real gRPC by a client
with its own Mooncake (TCP) engine and KV cache, with a real Redis: watermark eviction,
pins, reservation expiry, bytes through Redis, key-space isolation and status codes.
A meta-server process lists the members whose models may have key spaces (MODELS,
registered by the fixture with the test's layout). The fixture makes the key spaces of
"m" and "other" (empty) before any test, so the max_spaces test, whatever the order,
takes only spaces no other test needs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch
import yaml

from common.hashing import hash_block_chain, layout_key
from common.transfer import create_transfer
from common.transfer.kv_writes import KVSender
from common.kv_layout import KVLayout
from protos.pdmesh.v1 import kv_store_pb2 as pb
from protos.pdmesh.v1 import common_pb2, kv_store_pb2_grpc, meta_pb2, meta_pb2_grpc
from services.cli.launcher import wait_healthy
from tests.server_process import free_port
from tests.redis_server import RedisServer
from tests.channels import operator_channel_sync

ROOT = Path(__file__).resolve().parents[2]
BS, LAYERS, HEADS, DIM = 16, 2, 2, 16
SLOT_BYTES = LAYERS * 2 * BS * HEADS * DIM * 4              # 8 KiB per block
NUM_SLOTS = 10                                              # high 8, low 5
MODELS = ("m", "other", "codes", "space-0", "space-1", "space-2", "space-3")   # served by live members
HANG_GUARD_S = 30.0      # only catches a hang: a loaded machine may take many seconds
RESERVE_LEASE_S = 5.0    # a put's reserve -> write -> commit fits in it even on a loaded machine


@pytest.fixture(scope="module")
def redis(tmp_path_factory):
    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture(scope="module")
def store(tmp_path_factory, redis):
    root = tmp_path_factory.mktemp("kv-store")
    port, meta_port = free_port(), free_port()
    raw = {"model": str(root / "unused"), "transfer": {"backend": "mooncake"},
           "meta_server": {"port": meta_port, "ttl_seconds": 3600.0},
           "kv_store": {"port": port, "capacity_mb": NUM_SLOTS * SLOT_BYTES / (1 << 20), "max_spaces": 3,
                        "high_watermark": 0.8, "low_watermark": 0.5, "redis_url": redis.url},
           "timeouts": {"transfer_s": 0.5, "kv_store_reserve_lease_s": RESERVE_LEASE_S, "kv_store_pin_lease_s": 30.0}}
    (root / "mesh.yaml").write_text(yaml.safe_dump(raw))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = []
    for role in ("meta-server", "kv-store"):
        with open(root / f"{role}.log", "wb") as log:
            procs.append(subprocess.Popen([sys.executable, "-m", "services.cli", "serve", role, "--config",
                                           str(root / "mesh.yaml")], stdout=log, stderr=subprocess.STDOUT, env=env))
    meta, proc = procs
    address = f"127.0.0.1:{port}"
    try:
        wait_healthy(f"127.0.0.1:{meta_port}", 60, meta)
        register_members(f"127.0.0.1:{meta_port}")
        wait_healthy(address, 60, proc)
        with operator_channel_sync(address) as channel:
            stub = kv_store_pb2_grpc.KVStoreStub(channel)
            stub.address = address
            for model_id in ("m", "other"):
                make_space(stub, model_id)
            assert stub.Stats(pb.StatsRequest(), timeout=5).num_spaces == 2
            yield stub
    finally:
        for p in procs:
            p.terminate()
            p.wait(timeout=15)


def make_space(stub, model_id: str) -> None:
    """Makes model_id's key space, holding nothing: a PinGet that misses makes it (Redis
    may promote into it)."""
    node = Node(model_id)
    try:
        assert node.pin(stub, seq(0)).pin_id == ""
    finally:
        node.close()


def register_members(meta_address: str) -> None:
    """One live prefill member per model of MODELS, with the layout of Node's cache."""
    layout = Node.cache_layout()
    with operator_channel_sync(meta_address) as channel:
        stub = meta_pb2_grpc.MetaServerStub(channel)
        for i, model_id in enumerate(MODELS):
            info = common_pb2.NodeInfo(node_id=f"member-{i}", role="prefill", address=f"127.0.0.1:{40000 + i}",
                                       model_id=model_id, kv_layout=layout.to_proto())
            stub.Register(meta_pb2.RegisterRequest(node=info, ttl_seconds=3600.0, instance_id=f"i{i}"), timeout=5)


class Node:
    """A client node: a KV cache of 32 blocks with known contents, on Mooncake."""

    def __init__(self, model_id: str = "m", dtype=torch.float32):
        self.kv = torch.arange(LAYERS * 2 * 32 * BS * HEADS * DIM, dtype=torch.float32).to(dtype)
        self.kv = self.kv.view(LAYERS, 2, 32, BS, HEADS, DIM).clone()
        self.transfer = create_transfer("mooncake", hostname="127.0.0.1")
        self.transfer.register(self.kv.data_ptr(), self.kv.numel() * self.kv.element_size())
        self.layout = KVLayout.of_tensor(self.kv)
        self.sender = KVSender(self.transfer, self.layout)
        self.space = pb.KeySpace(model_id=model_id, layout=self.layout.to_proto())
        self.model_id = model_id

    @staticmethod
    def cache_layout() -> KVLayout:
        return KVLayout.of_tensor(torch.zeros(LAYERS, 2, 32, BS, HEADS, DIM))

    def chain(self, tokens: list[int]) -> list[bytes]:
        return hash_block_chain(tokens, BS, self.model_id, layout_key(self.layout))

    def put(self, stub, tokens: list[int], block_ids: list[int], commit: bool = True) -> pb.ReservePutResponse:
        reply = stub.ReservePut(pb.ReservePutRequest(space=self.space, block_hashes=self.chain(tokens),
                                                     token_ids=tokens), timeout=5)
        if reply.put_id:
            self.sender.send_blocks(reply.region.transfer_endpoint, KVLayout.from_proto(reply.region.layout),
                                    [block_ids[i] for i in reply.indices], list(reply.slot_ids))
            if commit:
                stub.CommitPut(pb.CommitPutRequest(put_id=reply.put_id), timeout=5)
        return reply

    def pin(self, stub, tokens: list[int]) -> pb.PinGetResponse:
        return stub.PinGet(pb.PinGetRequest(space=self.space, block_hashes=self.chain(tokens),
                                            token_ids=tokens), timeout=5)

    def lookup(self, stub, tokens: list[int]) -> pb.LookupResponse:
        return stub.Lookup(pb.LookupRequest(space=self.space, block_hashes=self.chain(tokens)), timeout=5)

    def fetch(self, reply: pb.PinGetResponse, block_ids: list[int]) -> None:
        self.sender.fetch_blocks(reply.region.transfer_endpoint, KVLayout.from_proto(reply.region.layout),
                                 list(reply.slot_ids), block_ids)

    def close(self) -> None:
        self.transfer.close()


def seq(start: int, blocks: int = 1) -> list[int]:
    return list(range(start, start + blocks * BS))


def test_store_service_end_to_end(store, redis):
    """Model m's key space (10 slots, empty: no other test writes to it) fills to the high
    watermark, evicts its least recently used unpinned blocks down to the low one, spills
    them to Redis and promotes them back byte for byte; other models never see its blocks;
    an uncommitted reservation expires."""
    a, other_model = Node("m"), Node("other")
    try:
        stats0 = store.Stats(pb.StatsRequest(), timeout=5)
        # fill to the high watermark (8 of 10 slots), one block per put, in LRU order 0..7
        slots = []
        for i in range(8):
            slots += a.put(store, seq(1000 * (i + 1)), [i]).slot_ids
        assert len(set(slots)) == 8, f"one new slot per put: {slots}"
        assert store.Stats(pb.StatsRequest(), timeout=5).evictions == stats0.evictions
        pinned = a.pin(store, seq(1000))                              # block 0: pinned, most recent
        assert list(pinned.slot_ids) == [slots[0]]
        # one more block passes the high watermark: LRU unpinned 1, 2, 3, 4 go, down to 5 used
        a.put(store, seq(9000), [8])
        stats = store.Stats(pb.StatsRequest(), timeout=5)
        assert stats.evictions - stats0.evictions == 4 and stats.blocks_used - stats0.blocks_used == 5
        assert [a.lookup(store, seq(1000 * (i + 1))).num_memory_hits for i in range(8)] == [1, 0, 0, 0, 0, 1, 1, 1]
        store.Release(pb.ReleaseRequest(pin_id=pinned.pin_id), timeout=5)

        # the evicted blocks come back from Redis with identical bytes
        deadline = time.monotonic() + HANG_GUARD_S
        while a.lookup(store, seq(2000)).num_hits != 1:
            assert time.monotonic() < deadline, "block 1 never reached Redis"
            time.sleep(0.05)
        back = a.pin(store, seq(2000))
        assert back.num_promoted == 1 and len(back.slot_ids) == 1
        a.fetch(back, [20])
        assert torch.equal(a.kv[:, :, 20], a.kv[:, :, 1])
        store.Release(pb.ReleaseRequest(pin_id=back.pin_id), timeout=5)

        # another model never sees these blocks, even when it sends the same hashes
        reply = store.PinGet(pb.PinGetRequest(space=other_model.space, block_hashes=a.chain(seq(1000)),
                                              token_ids=seq(1000)), timeout=5)
        assert reply.pin_id == "" and list(reply.slot_ids) == []

        # a reservation never committed expires (its lease, kv_store_reserve_lease_s, ends
        # and the store's expiry sweep counts it): its commit is then NOT_FOUND
        expired0 = store.Stats(pb.StatsRequest(), timeout=5).expired_reservations
        late = a.put(store, seq(50000), [9], commit=False)
        assert late.put_id
        deadline = time.monotonic() + RESERVE_LEASE_S + HANG_GUARD_S
        while store.Stats(pb.StatsRequest(), timeout=5).expired_reservations == expired0:
            assert time.monotonic() < deadline, "the reservation never expired"
            time.sleep(0.1)
        with pytest.raises(grpc.RpcError) as err:
            store.CommitPut(pb.CommitPutRequest(put_id=late.put_id), timeout=5)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert a.lookup(store, seq(50000)).num_hits == 0
        assert store.Stats(pb.StatsRequest(), timeout=5).expired_reservations - expired0 == 1
    finally:
        a.close()
        other_model.close()


def test_bad_requests_get_status_codes(store):
    node = Node("codes")
    try:
        with pytest.raises(grpc.RpcError) as err:
            store.ReservePut(pb.ReservePutRequest(space=node.space, block_hashes=[b"x"], token_ids=seq(0)), timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "block_hashes[0]" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            store.PinGet(pb.PinGetRequest(space=node.space, block_hashes=node.chain(seq(0)), token_ids=[1]), timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "token_ids" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            store.Lookup(pb.LookupRequest(space=pb.KeySpace(model_id="m"), block_hashes=[]), timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "space.layout" in err.value.details()
        # max_spaces is 3: new models get key spaces until the store holds 3, then are refused
        free = 3 - store.Stats(pb.StatsRequest(), timeout=5).num_spaces
        assert free >= 1, "the fixture's spaces leave room for one more"
        codes = []
        for i in range(4):
            extra = Node(f"space-{i}")
            try:
                extra.put(store, seq(0), [0])
                codes.append("OK")
            except grpc.RpcError as e:
                codes.append(e.code().name)
            finally:
                extra.close()
        assert codes == ["OK"] * free + ["RESOURCE_EXHAUSTED"] * (4 - free)
        assert store.Stats(pb.StatsRequest(), timeout=5).num_spaces == 3
    finally:
        node.close()


def test_cli_prints_the_store_stats(store, capsys):
    from services.cli import main
    assert main(["kv-store", "stats", "--kv-store", store.address, "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    want = store.Stats(pb.StatsRequest(), timeout=5)
    assert stats["blocks_total"] == want.blocks_total and stats["redis_configured"] is True
    assert main(["kv-store", "stats", "--kv-store", store.address]) == 0
    assert "redis_up" in capsys.readouterr().out
