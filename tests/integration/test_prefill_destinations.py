"""A prefill node writes only into the destination a live decode node registered
(services/prefill/destination_check.py). One process: a real meta-server, two decode
nodes and a prefill node (real node servers on 127.0.0.1 port 0, Mooncake over TCP),
and a caller that holds the mesh's identity (a mesh member gone rogue) sending forged
destinations straight to the prefill node: each is refused with its exact code, and the
decode node's KV bytes are unchanged (read back) and the prefill node wrote nothing. A
legitimate remote prefill through decode-0 still works, token for token, and the remote
path ran (its timing says remote and the prefill node's engine wrote the KV)."""
from __future__ import annotations

import asyncio
import ctypes
import time

import grpc
import pytest

from common.config import MeshConfig, MetaConfig, NodeConfig, TimeoutConfig, TransferConfig
from common.transfer import create_transfer
from common.kv_layout import KVLayout
from protos.pdmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc, meta_pb2, meta_pb2_grpc
from services.meta_server.server import create_server
from services.node.node_server import create_node_server, stop_node_server
from tests.channels import operator_channel


def _mooncake_importable() -> bool:
    try:
        import mooncake.engine  # noqa: F401
    except ImportError:
        return False
    return True


pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(not _mooncake_importable(), reason="mooncake.engine cannot be imported")]
TTL = 10.0   # no case needs a lease to lapse: a long one survives a stalled host
PROMPT = [(37 * i) % 500 + 3 for i in range(40)]           # 3 blocks of 16


class Mesh:
    async def start(self, model) -> "Mesh":
        self.meta, meta_port = await create_server(MetaConfig(port=0, ttl_seconds=TTL))
        mesh = MeshConfig(model=str(model), engine={"num_blocks": 32, "max_model_len": 256},
                          meta=MetaConfig(port=meta_port, ttl_seconds=TTL),
                          transfer=TransferConfig(backend="mooncake"), timeouts=TimeoutConfig())
        self.servers = {}
        for role, node_id in (("decode", "decode-0"), ("decode", "decode-1"), ("prefill", "prefill-0")):
            self.servers[node_id], _ = await create_node_server(mesh, NodeConfig(role, node_id), 0)
        self.meta_channel = operator_channel(f"127.0.0.1:{meta_port}")
        self.channels = {}
        deadline = time.monotonic() + 20
        while len(await self.members()) < 3:
            assert time.monotonic() < deadline, "nodes never registered"
            await asyncio.sleep(0.05)
        return self

    async def members(self) -> dict[str, common_pb2.NodeInfo]:
        reply = await meta_pb2_grpc.MetaServerStub(self.meta_channel).ListMembers(meta_pb2.ListMembersRequest())
        return {m.node_id: m for m in reply.nodes}

    def channel(self, node_id: str):
        if node_id not in self.channels:
            self.channels[node_id] = operator_channel(self.servers[node_id].node.address)
        return self.channels[node_id]

    def kv(self, node_id: str):
        return self.servers[node_id].node.llm_engine.kv_cache

    async def close(self) -> None:
        for ch in [self.meta_channel, *self.channels.values()]:
            await ch.close()
        for server in self.servers.values():
            await stop_node_server(server, 0.5)
        await self.meta.stop(None)
        await self.meta.close_extras()


def destination(info: common_pb2.NodeInfo, block_ids=(0, 1, 2), **changes) -> engine_pb2.KVDestination:
    dest = engine_pb2.KVDestination(node_id=info.node_id, transfer_endpoint=info.transfer_endpoint,
                                    block_ids=list(block_ids))
    dest.layout.CopyFrom(info.kv_layout)
    for name, value in changes.items():
        if name.startswith("layout_"):
            setattr(dest.layout, name.removeprefix("layout_"), value)
        else:
            setattr(dest, name, value)
    return dest


async def prefill(mesh: Mesh, rid: str, dest: engine_pb2.KVDestination) -> tuple[grpc.StatusCode, str]:
    stub = engine_pb2_grpc.PrefillStub(mesh.channel("prefill-0"))
    try:
        await stub.Prefill(engine_pb2.PrefillRequest(request_id=rid, prompt_token_ids=PROMPT, destination=dest,
                                                     sampling=common_pb2.SamplingParams(max_tokens=1)), timeout=30)
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details()
    return grpc.StatusCode.OK, ""


async def generate(mesh: Mesh, node_id: str, rid: str, prefill_info: common_pb2.NodeInfo | None):
    request = engine_pb2.DecodeRequest(request_id=rid, prompt_token_ids=PROMPT,
                                       sampling=common_pb2.SamplingParams(max_tokens=8, ignore_eos=True))
    if prefill_info is not None:
        request.prefill.CopyFrom(prefill_info)
    tokens, timing = [], None
    async for reply in engine_pb2_grpc.DecodeStub(mesh.channel(node_id)).Generate(request, timeout=60):
        tokens += list(reply.token_ids)
        if reply.HasField("prefill_timing") and timing is None:
            timing = reply.prefill_timing
    return tokens, timing


def test_forged_destinations_are_refused_and_write_nothing(tiny_model):
    async def scenario():
        mesh = await Mesh().start(tiny_model("llama"))
        rogue = create_transfer("mooncake", hostname="127.0.0.1")   # an endpoint nobody registered
        rogue_buf = ctypes.create_string_buffer(b"\x5a" * (1 << 20), 1 << 20)
        try:
            rogue.register(ctypes.addressof(rogue_buf), 1 << 20)
            members = await mesh.members()
            d0, d1, p0 = members["decode-0"], members["decode-1"], members["prefill-0"]
            before = mesh.kv("decode-0").clone()
            layout = KVLayout.from_proto(d0.kv_layout)
            rogue_layout = common_pb2.KVLayout()
            rogue_layout.CopyFrom(d0.kv_layout)
            rogue_layout.base_address = ctypes.addressof(rogue_buf)
            cases = {
                # another decode node's id, decode-0's endpoint and layout
                "other-id": (destination(d0, node_id=d1.node_id), grpc.StatusCode.PERMISSION_DENIED,
                             "destination.transfer_endpoint"),
                # a live member that is not a decode node
                "prefill-id": (destination(d0, node_id=p0.node_id), grpc.StatusCode.PERMISSION_DENIED,
                               "not a live decode node"),
                "unknown-id": (destination(d0, node_id="decode-9"), grpc.StatusCode.PERMISSION_DENIED,
                               "not a live decode node"),
                "base-address": (destination(d0, layout_base_address=layout.base_address + layout.block_bytes),
                                 grpc.StatusCode.PERMISSION_DENIED, "destination.layout.base_address"),
                "num-blocks": (destination(d0, block_ids=(0, 1, layout.num_blocks + 5),
                                           layout_num_blocks=layout.num_blocks + 8),
                               grpc.StatusCode.PERMISSION_DENIED, "destination.layout.num_blocks"),
                "block-range": (destination(d0, block_ids=(0, 1, layout.num_blocks)),
                                grpc.StatusCode.INVALID_ARGUMENT, f"destination.block_ids[2] = {layout.num_blocks}"),
                "negative-block": (destination(d0, block_ids=(0, -1, 2)),
                                   grpc.StatusCode.INVALID_ARGUMENT, "destination.block_ids[1] = -1"),
                "rogue-endpoint": (destination(d0, transfer_endpoint=rogue.endpoint),
                                   grpc.StatusCode.PERMISSION_DENIED, "destination.transfer_endpoint"),
            }
            rogue_dest = destination(d0, transfer_endpoint=rogue.endpoint)
            rogue_dest.layout.CopyFrom(rogue_layout)
            cases["rogue-endpoint-and-layout"] = (rogue_dest, grpc.StatusCode.PERMISSION_DENIED,
                                                  "destination.transfer_endpoint")
            results = {name: await prefill(mesh, f"forged-{name}", dest) for name, (dest, _, _) in cases.items()}
            await asyncio.sleep(0.3)    # anything in flight would have landed by now
            for name, (_, code, words) in cases.items():
                got_code, details = results[name]
                assert got_code == code and words in details, (name, got_code, details)
            assert mesh.servers["prefill-0"].node.transfer.bytes_written == 0
            assert mesh.kv("decode-0").equal(before)
            assert rogue_buf.raw == b"\x5a" * (1 << 20)
            # the same call, unforged, is served (it writes blocks 0-2 of decode-0: in range, and
            # which request they belong to is beyond the check, docs/security-data-plane.md)
            assert (await prefill(mesh, "unforged", destination(d0)))[0] == grpc.StatusCode.OK
            assert mesh.servers["prefill-0"].node.transfer.bytes_written > 0
        finally:
            rogue.close()
            await mesh.close()
    asyncio.run(scenario())


def test_a_remote_prefill_still_works_and_ran_remotely(tiny_model):
    async def scenario():
        mesh = await Mesh().start(tiny_model("llama"))
        try:
            members = await mesh.members()
            prefill_node = mesh.servers["prefill-0"].node
            remote, timing = await generate(mesh, "decode-0", "remote-1", members["prefill-0"])
            assert timing is not None and timing.remote
            assert prefill_node.transfer.bytes_written > 0
            assert mesh.servers["decode-0"].node.transfer.bytes_written == 0
            local, local_timing = await generate(mesh, "decode-1", "local-1", None)
            assert local_timing is None or not local_timing.remote
            assert remote == local and len(remote) == 8
        finally:
            await mesh.close()
    asyncio.run(scenario())
