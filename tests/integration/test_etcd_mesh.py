"""A mesh whose membership lives in etcd (real etcd, real processes): nodes join through
their leases, and an etcd outage while requests flow fails no request."""
from __future__ import annotations

import asyncio
import time

import grpc

from protos.pdmesh.v1 import meta_pb2, meta_pb2_grpc
from tests.etcd_server import EtcdServer
from tests.integration.test_mesh import assert_no_blocks_in_use, request, stream


def listed(mesh) -> set[str]:
    with grpc.insecure_channel(mesh.meta_address) as ch:
        nodes = meta_pb2_grpc.MetaServerStub(ch).ListMembers(meta_pb2.ListMembersRequest(), timeout=5).nodes
    return {n.node_id for n in nodes}


def test_etcd_outage_while_serving(tiny_model, start_mesh, tmp_path):
    with EtcdServer(tmp_path / "etcd") as etcd:
        mesh = start_mesh(tiny_model("llama"), top={"etcd_endpoint": etcd.endpoint, "cluster": "itest"},
                          ttl_seconds=2.0)
        assert listed(mesh) == {"prefill-0", "decode-0"}
        expected, _, _ = asyncio.run(stream(mesh.gateway_address, request([7, 8, 9, 10] * 20, max_tokens=8)))

        async def traffic(seconds: float) -> list:
            results, deadline = [], time.monotonic() + seconds
            while time.monotonic() < deadline:
                tokens, _, msgs = await stream(mesh.gateway_address, request([7, 8, 9, 10] * 20, max_tokens=8))
                results.append((tokens, msgs[-1].finish_reason))
                await asyncio.sleep(0.2)
            return results

        async def outage():
            task = asyncio.create_task(traffic(14.0))
            await asyncio.sleep(1.0)
            await asyncio.to_thread(etcd.stop)
            await asyncio.sleep(10.0)
            await asyncio.to_thread(etcd.start)
            return await task

        results = asyncio.run(outage())
        assert len(results) >= 10
        assert all(r == (expected, "length") for r in results)
        deadline = time.monotonic() + 2.0 + 1.0
        while listed(mesh) != {"prefill-0", "decode-0"}:
            assert time.monotonic() < deadline, f"listed after restart: {listed(mesh)}"
            time.sleep(0.1)
        assert_no_blocks_in_use(mesh)
        mesh.stop()
