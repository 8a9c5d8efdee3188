"""How an engine node stays in the mesh: keep it registered and report its load every
TTL/3 until close(). One interface, two implementations; create_registration is the one
place that picks (etcd when the mesh has an etcd_endpoint), to match the meta-server's
registry (services/meta_server/registry):

  RpcRegistration   Register with the meta-server, then Heartbeat(load); register again
                    when the meta-server forgot the node (NOT_FOUND) or was unreachable;
                    close() deregisters.
  EtcdRegistration  NodeInfo on the node's own etcd lease (a common.cluster Membership
                    keeps the lease alive and re-registers after it expired), put again
                    with the current load each time; close() revokes the lease.

Expert counts (a Mixture-of-Experts node: `expert_tokens` returns MoE layer -> tokens per
expert; {} for a dense model) go to the meta-server only, never inside the NodeInfo (which
the meta-server hands out with every route), and only when they differ from the last ones
it took (always the first): RpcRegistration in HeartbeatRequest.expert_tokens (again after
each Register), EtcdRegistration as ExpertTokens under a key of its own,
/pdmesh/<cluster>/nodes/expert-tokens/<node_id> on a second lease (EXPERT_TOKENS_ROLE;
the meta-server's EtcdRegistry keeps it beside the member).

Lifecycle: start() (a task of the running loop; returns at once) -> report every TTL/3
(every RETRY_S while not registered; at once after report_now()) -> close(). Never raises because the meta-server or etcd is away: it logs and retries.
`node_info` is called for every report and returns the node's current NodeInfo.
"""
from __future__ import annotations

import abc
import asyncio
import secrets
import logging
from typing import Callable

import grpc

from common.config import MeshConfig
from protos.pdmesh.v1 import common_pb2, meta_pb2, meta_pb2_grpc
from services.node import grpc_util

log = logging.getLogger("pdmesh.node")

NodeInfoFn = Callable[[], common_pb2.NodeInfo]
ExpertTokensFn = Callable[[], dict[int, list[int]]]
# the etcd "role" of the key holding a node's ExpertTokens (never a node's role)
EXPERT_TOKENS_ROLE = "expert-tokens"
# While not registered (the meta-server restarted, or was away), try again this often: a
# restarted meta-server has every live node back within a second.
RETRY_S = 0.25


def expert_tokens_proto(counts: dict[int, list[int]]) -> common_pb2.ExpertTokens:
    return common_pb2.ExpertTokens(layers=[common_pb2.LayerExpertTokens(layer=layer, num_tokens=row)
                                           for layer, row in counts.items()])


class NodeRegistration(abc.ABC):
    def __init__(self, node_info: NodeInfoFn, ttl_s: float, expert_tokens: ExpertTokensFn | None = None):
        self.node_info, self.ttl_s = node_info, ttl_s
        self.expert_tokens = expert_tokens
        self._sent_tokens: dict[int, list[int]] | None = None   # the counts the other side last took
        self._task: asyncio.Task | None = None
        self._now = asyncio.Event()

    def _changed_tokens(self) -> dict[int, list[int]] | None:
        """The expert counts to send now: None when there are none (a dense model) or they
        are what the other side last took."""
        counts = self.expert_tokens() if self.expert_tokens is not None else None
        return counts if counts and counts != self._sent_tokens else None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="node registration")

    def report_now(self) -> None:
        """Report at once instead of at the next TTL/3 tick (the node's state changed)."""
        self._now.set()

    async def _run(self) -> None:
        while True:
            self._now.clear()
            try:
                await self._report()
            except Exception:
                log.exception("node registration: report failed; retrying")
            interval = self.ttl_s / 3 if self.registered else min(self.ttl_s / 3, RETRY_S)
            try:
                await asyncio.wait_for(self._now.wait(), interval)
            except asyncio.TimeoutError:
                pass

    @property
    @abc.abstractmethod
    def registered(self) -> bool:
        """True while the node is believed registered."""

    @abc.abstractmethod
    async def _report(self) -> None:
        """Register if not registered, else report the current load. Logs (does not
        raise) when the other side is away."""

    @abc.abstractmethod
    async def _leave(self) -> None:
        """Leave the mesh now; best effort."""

    async def close(self) -> None:
        """Stop reporting and leave. Idempotent."""
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await self._leave()


class RpcRegistration(NodeRegistration):
    def __init__(self, meta_address: str, node_info: NodeInfoFn, ttl_s: float,
                 expert_tokens: ExpertTokensFn | None = None):
        super().__init__(node_info, ttl_s, expert_tokens)
        self.meta_address = meta_address
        self._channel = grpc_util.channel(meta_address)
        self._stub = meta_pb2_grpc.MetaServerStub(self._channel)
        self._registered = False
        self.instance_id = secrets.token_hex(16)   # this process: the registry tells it from another

    @property
    def registered(self) -> bool:
        return self._registered

    async def _report(self) -> None:
        info = self.node_info()
        try:
            if self._registered:
                request = meta_pb2.HeartbeatRequest(node_id=info.node_id, load=info.load, instance_id=self.instance_id)
                counts = self._changed_tokens()
                if counts is not None:
                    request.expert_tokens.CopyFrom(expert_tokens_proto(counts))
                try:
                    await self._stub.Heartbeat(request, timeout=self.ttl_s)
                    if counts is not None:
                        self._sent_tokens = counts
                    return
                except grpc.aio.AioRpcError as e:
                    if e.code() != grpc.StatusCode.NOT_FOUND:
                        raise
                    self._registered = False       # the meta-server forgot us: register now
            reply = await self._stub.Register(meta_pb2.RegisterRequest(node=info, instance_id=self.instance_id),
                                              timeout=self.ttl_s)
            if reply.ttl_seconds > 0:
                self.ttl_s = reply.ttl_seconds      # the registry's TTL paces the heartbeats
            self._registered = True
            self._sent_tokens = None                # a join starts without counts: send them next
            log.info("%s registered with the meta-server at %s", info.node_id, self.meta_address)
        except grpc.aio.AioRpcError as e:
            self._registered = False
            log.warning("meta-server at %s: %s %s; retrying", self.meta_address, e.code().name, e.details())

    async def _leave(self) -> None:
        try:
            await self._stub.Deregister(meta_pb2.DeregisterRequest(node_id=self.node_info().node_id,
                                                                   instance_id=self.instance_id), timeout=1)
        except grpc.aio.AioRpcError:
            pass
        self._registered = False
        await self._channel.close()


class EtcdRegistration(NodeRegistration):
    def __init__(self, etcd_cfg, node_info: NodeInfoFn, ttl_s: float, expert_tokens: ExpertTokensFn | None = None):
        """etcd_cfg: a common.cluster EtcdConfig."""
        from common.cluster.etcd import EtcdCluster
        super().__init__(node_info, ttl_s, expert_tokens)
        self._cluster = EtcdCluster(etcd_cfg)
        self.membership = self._cluster.membership()
        self.expert_membership = self._cluster.membership()   # started with the first counts
        self._started = False

    @property
    def registered(self) -> bool:
        return self.membership.registered

    async def _report(self) -> None:
        info = self.node_info()
        if self._started:
            await self.membership.update(info.SerializeToString())
        else:
            self._started = True
            await self.membership.start(info.role, info.node_id, info.SerializeToString(), ttl_s=self.ttl_s)
            log.info("%s registering in etcd at %s", info.node_id, self._cluster.cfg.endpoint)
        counts = self._changed_tokens()
        if counts is None:
            return
        value = expert_tokens_proto(counts).SerializeToString()
        # the membership keeps the last value and puts it again (after an outage, on a new lease)
        if self._sent_tokens is None:
            await self.expert_membership.start(EXPERT_TOKENS_ROLE, info.node_id, value, ttl_s=self.ttl_s)
        else:
            await self.expert_membership.update(value)
        self._sent_tokens = counts

    async def _leave(self) -> None:
        await self.membership.close()
        await self.expert_membership.close()
        await self._cluster.close()


def create_registration(mesh: MeshConfig, node_info: NodeInfoFn,
                        expert_tokens: ExpertTokensFn | None = None) -> NodeRegistration:
    """In etcd when the mesh has an etcd_endpoint, else with the meta-server; either way
    on the meta-server's TTL. expert_tokens: the engine's (None: no expert counts)."""
    etcd = mesh.etcd_config()
    if etcd is not None:
        return EtcdRegistration(etcd, node_info, mesh.meta.ttl_seconds, expert_tokens)
    return RpcRegistration(mesh.meta.address, node_info, mesh.meta.ttl_seconds, expert_tokens)
