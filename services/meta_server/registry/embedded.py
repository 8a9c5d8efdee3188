"""The embedded registry: the meta-server is the registry itself (no etcd configured).

Nodes feed it over gRPC: Register (a join, with the node's TTL) -> Heartbeat every TTL/3
with the node's load (a report) -> Deregister on a clean shutdown (forgotten at once).
A member with no heartbeat for its TTL is gone (down); its next heartbeat returns False
and the node registers again. Lifecycle and reads: base.Registry.
"""
from __future__ import annotations

from protos.pdmesh.v1 import common_pb2
from services.meta_server.registry.base import DOWN, Member, Registry


class EmbeddedRegistry(Registry):
    async def start(self) -> None:
        """Nothing to follow: the RPCs feed the table."""

    async def close(self) -> None:
        """Nothing to release."""

    def register(self, info: common_pb2.NodeInfo, ttl_s: float = 0.0) -> float:
        ttl = ttl_s if ttl_s > 0 else self.default_ttl_s
        self._join(info, ttl)
        return ttl

    def heartbeat(self, node_id: str, load: common_pb2.NodeLoad) -> bool:
        self._sweep()
        member = self._members.get(node_id)
        if member is None or member.state == DOWN:
            return False
        member.info.load.CopyFrom(load)
        self._report(member)
        return True

    def deregister(self, node_id: str) -> bool:
        return self._forget(node_id)

    def _expired(self, member: Member, now: float) -> bool:
        return now - member.last_seen > member.ttl_s
