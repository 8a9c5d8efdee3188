"""What a prefill, decode or `both` node runs besides its servicer: the engine, the KV
cache registered with the transfer engine, and membership (register, then heartbeat
every TTL/3 with the node's load; register again when the meta-server forgot us).

Lifecycle: EngineNode(...) loads the model and registers the KV cache -> start(address)
begins membership -> close() deregisters, stops the engine and the transfer engine.
"""
from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

import grpc

from common.config import MeshConfig, NodeConfig
from common.engine.async_engine import AsyncEngine
from common.engine.llm_engine import LLMEngine
from common.transfer.kv_writes import KVSender
from common.transfer.layout import KVLayout
from common.transfer.registry import create_transfer
from protos.pdmesh.v1 import common_pb2, engine_pb2, meta_pb2, meta_pb2_grpc
from services import grpc_util
from services.kv_store.client import KVStoreClient

log = logging.getLogger("pdmesh.node")


def transfer_options(mesh: MeshConfig, advertised_host: str) -> dict:
    """Backend keyword arguments for a service advertised at advertised_host (an empty
    transfer.hostname means that host)."""
    t = mesh.transfer
    hostname = t.hostname or advertised_host
    if t.backend == "mooncake":
        return dict(hostname=hostname, protocol=t.protocol, metadata_server=t.metadata_server,
                    device_name=t.device_name)
    if t.backend == "grpc":
        return dict(host=hostname)
    return {}


class EngineNode:
    def __init__(self, mesh: MeshConfig, node: NodeConfig):
        self.mesh, self.node = mesh, node
        self.llm_engine = LLMEngine(mesh.engine_config())
        self.engine = AsyncEngine(self.llm_engine)
        self.transfer = create_transfer(mesh.transfer.backend, **transfer_options(mesh, node.advertised_host))
        kv = self.llm_engine.kv_cache
        self.transfer.register(kv.data_ptr(), kv.numel() * kv.element_size())
        self.layout = KVLayout.of_tensor(kv)
        self.sender = KVSender(self.transfer, self.layout)
        self.executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix=f"{node.node_id}-kv")
        self.kv_store: KVStoreClient | None = None
        if mesh.kv_store is not None and node.role == "prefill":
            self.kv_store = KVStoreClient(mesh.kv_store.address, self.llm_engine.model_id, self.layout,
                                          self.sender, self.executor, mesh.kv_store.client_timeout_s)
        self.address = ""
        self._membership: asyncio.Task | None = None
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._etcd = self._etcd_membership = None
        self._meta: grpc.aio.Channel | None = None

    def node_info(self) -> common_pb2.NodeInfo:
        stats = self.llm_engine.stats()
        return common_pb2.NodeInfo(
            node_id=self.node.node_id, role=self.node.role, address=self.address,
            model_id=self.llm_engine.model_id, transfer_backend=self.transfer.name,
            transfer_endpoint=self.transfer.endpoint, kv_layout=self.layout.to_proto(),
            load=self.load(stats), max_model_len=self.llm_engine.max_model_len)

    @staticmethod
    def load(stats: dict[str, int]) -> common_pb2.NodeLoad:
        return common_pb2.NodeLoad(running=stats["running"] + stats["remote_prefill"],
                                   waiting=stats["waiting"], free_blocks=stats["free_blocks"],
                                   total_blocks=stats["total_blocks"])

    def engine_stats(self, pending_transfers: int = 0) -> engine_pb2.EngineStats:
        s = self.llm_engine.stats()
        return engine_pb2.EngineStats(
            node_id=self.node.node_id, running=s["running"], waiting=s["waiting"],
            used_blocks=s["used_blocks"], free_blocks=s["free_blocks"],
            total_blocks=s["total_blocks"], pending_transfers=pending_transfers,
            prefix_hit_tokens=s["prefix_hit_tokens"])

    def channel(self, address: str) -> grpc.aio.Channel:
        """A long-lived channel to a peer node (connections are reused across requests)."""
        if address not in self._channels:
            self._channels[address] = grpc_util.channel(address)
        return self._channels[address]

    # ---- membership ---------------------------------------------------------------
    def start(self, address: str) -> None:
        self.address = address
        self._meta = grpc_util.channel(self.mesh.meta.address)
        loop = asyncio.get_running_loop()
        if self.mesh.etcd_endpoint:
            self._membership = loop.create_task(self._etcd_membership_loop())
        else:
            self._membership = loop.create_task(self._membership_loop())

    async def _etcd_membership_loop(self) -> None:
        """NodeInfo on an etcd lease (refreshed by the Membership), load every TTL/3."""
        from common.cluster.etcd import EtcdCluster, EtcdConfig
        self._etcd = EtcdCluster(EtcdConfig(endpoint=self.mesh.etcd_endpoint, cluster=self.mesh.cluster))
        self._etcd_membership = self._etcd.membership()
        ttl = self.mesh.meta.ttl_seconds
        await self._etcd_membership.start(self.node.role, self.node.node_id,
                                          self.node_info().SerializeToString(), ttl_s=ttl)
        log.info("%s registered in etcd at %s", self.node.node_id, self.mesh.etcd_endpoint)
        while True:
            await asyncio.sleep(ttl / 3)
            await self._etcd_membership.update(self.node_info().SerializeToString())

    async def _membership_loop(self) -> None:
        stub = meta_pb2_grpc.MetaServerStub(self._meta)
        ttl = self.mesh.meta.ttl_seconds
        registered = False
        while True:
            try:
                if not registered:
                    await stub.Register(meta_pb2.RegisterRequest(node=self.node_info(), ttl_seconds=ttl),
                                        timeout=ttl)
                    registered = True
                    log.info("%s registered with the meta-server at %s", self.node.node_id,
                             self.mesh.meta.address)
                else:
                    await stub.Heartbeat(meta_pb2.HeartbeatRequest(
                        node_id=self.node.node_id, load=self.load(self.llm_engine.stats())),
                        timeout=ttl)
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.NOT_FOUND:
                    registered = False
                    continue
                log.warning("meta-server unreachable (%s); retrying", e.code().name)
                registered = False
            await asyncio.sleep(ttl / 3)

    async def close(self) -> None:
        if self._etcd is not None:
            self._membership.cancel()
            await self._etcd_membership.close()
            await self._etcd.close()
        elif self._membership is not None:
            self._membership.cancel()
            try:
                stub = meta_pb2_grpc.MetaServerStub(self._meta)
                await stub.Deregister(meta_pb2.DeregisterRequest(node_id=self.node.node_id), timeout=1)
            except grpc.aio.AioRpcError:
                pass
            await self._meta.close()
        for ch in self._channels.values():
            await ch.close()
        if self.kv_store is not None:
            await self.kv_store.close()
        self.engine.shutdown()
        self.executor.shutdown(wait=True)
        self.transfer.close()
