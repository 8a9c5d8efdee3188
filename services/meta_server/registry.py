"""The embedded registry: the meta-server's own node table when no etcd is configured.

Lifecycle of a member:
  register -> up (heartbeats every TTL/3 carry its load)
  -> no heartbeat for TTL -> down: still listed (for operators), never routed to;
     a heartbeat now returns False and the node must register again
  -> down for `down_retention_ttls` TTLs -> forgotten
  deregister (clean shutdown) or remove (operator) forget it at once.
Expiry is lazy: every look at the table (heartbeat, alive, members) applies it first.

Thread-safety: used from the meta-server's event loop only.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from protos.pdmesh.v1 import common_pb2

UP, DOWN = "up", "down"


@dataclass
class Member:
    info: common_pb2.NodeInfo          # opaque to the registry; handed back by Route
    ttl_s: float
    last_seen: float
    routed_since_heartbeat: int = 0    # requests routed here since its last load report
    down_since: float | None = None    # set when the TTL expired

    @property
    def node_id(self) -> str:
        return self.info.node_id

    @property
    def role(self) -> str:
        return self.info.role

    @property
    def state(self) -> str:
        return UP if self.down_since is None else DOWN

    def load_score(self) -> float:
        """Requests in flight (running + waiting at the last heartbeat + routed since) plus
        the fraction of KV blocks in use; lower is less loaded."""
        load = self.info.load
        busy = load.running + load.waiting + self.routed_since_heartbeat
        used = 1.0 - load.free_blocks / load.total_blocks if load.total_blocks else 0.0
        return busy + used


@dataclass
class EmbeddedRegistry:
    default_ttl_s: float = 3.0
    down_retention_ttls: float = 10.0
    clock: Callable[[], float] = time.monotonic
    _members: dict[str, Member] = field(default_factory=dict)

    def register(self, info: common_pb2.NodeInfo, ttl_s: float = 0.0) -> float:
        """Add or replace the member (state up); returns the TTL granted."""
        ttl = ttl_s if ttl_s > 0 else self.default_ttl_s
        member = Member(common_pb2.NodeInfo(), ttl, self.clock())
        member.info.CopyFrom(info)
        self._members[info.node_id] = member
        return ttl

    def heartbeat(self, node_id: str, load: common_pb2.NodeLoad) -> bool:
        """Record the load of a live member; False if unknown or down (register again)."""
        self.expire()
        member = self._members.get(node_id)
        if member is None or member.state == DOWN:
            return False
        member.last_seen = self.clock()
        member.info.load.CopyFrom(load)
        member.routed_since_heartbeat = 0
        return True

    def deregister(self, node_id: str) -> bool:
        return self._members.pop(node_id, None) is not None

    def mark_down(self, node_id: str) -> bool:
        """An external source (the node's etcd lease) says the member is gone."""
        member = self._members.get(node_id)
        if member is None or member.down_since is not None:
            return False
        member.down_since = self.clock()
        return True

    remove = deregister

    def expire(self) -> list[str]:
        """Mark members past their TTL down, forget long-down ones; returns the newly down."""
        now = self.clock()
        newly_down = []
        for m in list(self._members.values()):
            if m.down_since is None and now - m.last_seen > m.ttl_s:
                m.down_since = now
                newly_down.append(m.node_id)
            elif m.down_since is not None and now - m.down_since > self.down_retention_ttls * min(
                    m.ttl_s, self.default_ttl_s):
                del self._members[m.node_id]
        return newly_down

    def get(self, node_id: str) -> Member | None:
        self.expire()
        return self._members.get(node_id)

    def members(self) -> list[Member]:
        """Every listed member, up or down."""
        self.expire()
        return list(self._members.values())

    def alive(self) -> list[Member]:
        """Members that are up (routable unless drained)."""
        return [m for m in self.members() if m.state == UP]

    def seconds_since_heartbeat(self, member: Member) -> float:
        return self.clock() - member.last_seen
