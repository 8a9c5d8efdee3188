"""The embedded registry: the meta-server is the registry itself (no etcd configured).

Nodes feed it over gRPC: Register (a join; the TTL is the registry's) -> Heartbeat every
TTL/3 with the node's load (a report) -> Deregister on a clean shutdown (forgotten at
once). A member with no heartbeat for its TTL is gone (down); its next heartbeat returns
False and the node registers again. A MoE node's heartbeat carries its expert counts when
they changed (and in its first after each Register): kept until the next ones, dropped
when it joins again or is forgotten. Each call names the node process (instance_id): while
a member is up, only the instance that joined may report for it, replace it or remove it;
another one waits until the lease lapsed (a restarted node: at most one TTL). Lifecycle
and reads: base.Registry.
"""
from __future__ import annotations

from protos.pdmesh.v1 import common_pb2
from services.meta_server.registry.base import DOWN, ExpertTokens, Member, RegistrationConflictError, Registry


class EmbeddedRegistry(Registry):
    async def start(self) -> None:
        """Nothing to follow: the RPCs feed the table."""

    async def close(self) -> None:
        """Nothing to release."""

    def _held_by_other(self, node_id: str, instance_id: str) -> Member | None:
        self._sweep()
        member = self._members.get(node_id)
        if member is not None and member.state != DOWN and member.instance_id != instance_id:
            return member
        return None

    def register(self, info: common_pb2.NodeInfo, instance_id: str = "") -> float:
        holder = self._held_by_other(info.node_id, instance_id)
        if holder is not None:
            left = holder.ttl_s - self.seconds_since_heartbeat(holder)
            raise RegistrationConflictError(
                f"node_id {info.node_id!r} is held by another live process; it may register in {left:.1f}s "
                "if that one stops reporting")
        for m in self._members.values():
            if (m.node_id != info.node_id and m.state != DOWN and info.transfer_endpoint
                    and m.info.transfer_endpoint == info.transfer_endpoint
                    and m.info.kv_layout.base_address == info.kv_layout.base_address):
                raise RegistrationConflictError("this transfer endpoint and KV cache belong to another live node")
        self._expert_tokens.pop(info.node_id, None)     # its next heartbeat brings them
        self._join(info, self.default_ttl_s, instance_id)
        return self.default_ttl_s

    def heartbeat(self, node_id: str, load: common_pb2.NodeLoad, instance_id: str = "",
                  expert_tokens: ExpertTokens | None = None) -> bool:
        self._sweep()
        member = self._members.get(node_id)
        if member is None or member.state == DOWN or member.instance_id != instance_id:
            return False
        member.info.load.CopyFrom(load)
        if expert_tokens is not None:
            self._expert_tokens[node_id] = expert_tokens
        self._report(member)
        return True

    def deregister(self, node_id: str, instance_id: str = "") -> bool:
        if self._held_by_other(node_id, instance_id) is not None:
            raise RegistrationConflictError(f"node_id {node_id!r} was registered by another process")
        return self._forget(node_id)

    def _forget(self, node_id: str) -> bool:
        self._expert_tokens.pop(node_id, None)
        return super()._forget(node_id)

    def _expired(self, member: Member, now: float) -> bool:
        return now - member.last_seen > member.ttl_s
