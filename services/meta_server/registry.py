"""The embedded registry: the meta-server's own node table when no etcd is configured.

A node registers its NodeInfo with a TTL and heartbeats its load; a node whose last
heartbeat is older than the TTL is expired (removed) on the next look. A heartbeat from
an unknown node returns False: it must register again (e.g. after a meta-server restart).

Thread-safety: used from the meta-server's event loop only.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from protos.pdmesh.v1 import common_pb2


@dataclass
class Member:
    info: common_pb2.NodeInfo          # opaque to the registry; handed back by Route
    ttl_s: float
    last_seen: float
    routed_since_heartbeat: int = 0    # requests routed here since its last load report
    num_routed: int = 0

    @property
    def node_id(self) -> str:
        return self.info.node_id

    @property
    def role(self) -> str:
        return self.info.role

    def load_score(self) -> float:
        load = self.info.load
        busy = load.running + load.waiting + self.routed_since_heartbeat
        used = 1.0 - load.free_blocks / load.total_blocks if load.total_blocks else 0.0
        return busy + used


@dataclass
class EmbeddedRegistry:
    default_ttl_s: float = 3.0
    clock: callable = time.monotonic
    members: dict[str, Member] = field(default_factory=dict)

    def register(self, info: common_pb2.NodeInfo, ttl_s: float = 0.0) -> float:
        ttl = ttl_s if ttl_s > 0 else self.default_ttl_s
        old = self.members.get(info.node_id)
        member = Member(common_pb2.NodeInfo(), ttl, self.clock())
        member.info.CopyFrom(info)
        if old is not None:
            member.num_routed = old.num_routed
        self.members[info.node_id] = member
        return ttl

    def heartbeat(self, node_id: str, load: common_pb2.NodeLoad) -> bool:
        self.expire()
        member = self.members.get(node_id)
        if member is None:
            return False
        member.last_seen = self.clock()
        member.info.load.CopyFrom(load)
        member.routed_since_heartbeat = 0
        return True

    def deregister(self, node_id: str) -> bool:
        return self.members.pop(node_id, None) is not None

    def expire(self) -> list[str]:
        now = self.clock()
        gone = [m.node_id for m in self.members.values() if now - m.last_seen > m.ttl_s]
        for node_id in gone:
            del self.members[node_id]
        return gone

    def alive(self) -> list[Member]:
        self.expire()
        return list(self.members.values())
