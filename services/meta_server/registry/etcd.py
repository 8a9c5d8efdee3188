"""The etcd registry: the table follows the keys that nodes keep on their own etcd leases,
/pdmesh/<cluster>/nodes/<role>/<node_id> -> NodeInfo (services/node/node_registration.py).

The keys are listed at start and then watched from the next revision by a common.cluster
MemberView, which re-watches from the last seen revision + 1 after an etcd outage and
lists again after a compaction. Each change of a key:
  put, member unknown or down -> joins (up)
  put, member up              -> reports (its NodeInfo and load replaced; nodes put every
                                 TTL/3, so seconds_since_heartbeat stays below TTL/3 too)
  delete (lease expired, or revoked by a clean shutdown) -> gone (down)
A MoE node also keeps its expert counts (an ExpertTokens) on a second lease, under
/pdmesh/<cluster>/nodes/expert-tokens/<node_id> (EXPERT_TOKENS_ROLE), put only when they
changed: they are kept beside the member from each put until that key is deleted, never
in its NodeInfo (and the key never makes a member).
Nothing expires by time here: a node's lease is its liveness. While etcd is unreachable
no change arrives, so the last known view is served (and routed on) unchanged; a node
whose lease expired meanwhile puts its key again on a new lease and joins again.
Register / Heartbeat / Deregister RPCs are refused (RegistrationRefusedError).
"""
from __future__ import annotations

import logging

from google.protobuf.message import DecodeError

from common.cluster.base import ChangeKind, MemberChange
from protos.pdmesh.v1 import common_pb2
from services.meta_server.registry.base import DOWN, Registry, expert_tokens_of
from services.meta_server.node_info_check import node_info_error
from services.node.node_registration import EXPERT_TOKENS_ROLE

log = logging.getLogger("pdmesh.meta")


class EtcdRegistry(Registry):
    def __init__(self, cluster, **kwargs):
        """cluster: a common.cluster EtcdCluster (shared; the caller closes it)."""
        super().__init__(**kwargs)
        self.refusal = (f"nodes of cluster {cluster.cfg.cluster!r} register in etcd at "
                        f"{cluster.cfg.endpoint}, not with the meta-server: set the same "
                        "etcd_endpoint in the node's mesh config")
        self._view = cluster.member_view(on_change=self._on_change)

    async def start(self) -> None:
        await self._view.start()

    async def close(self) -> None:
        await self._view.close()

    @property
    def revision(self) -> int | None:
        """The etcd revision the table reflects: every change up to it is applied."""
        return self._view.revision

    def _on_expert_tokens(self, change: MemberChange) -> None:
        if change.kind == ChangeKind.REMOVED:
            self._expert_tokens.pop(change.node_id, None)
            return
        try:
            self._expert_tokens[change.node_id] = expert_tokens_of(common_pb2.ExpertTokens.FromString(change.value))
        except DecodeError:
            log.warning("ignoring etcd key %s/%s: its value is not an ExpertTokens", EXPERT_TOKENS_ROLE,
                        change.node_id[:128])

    def _on_change(self, change: MemberChange) -> None:
        if change.role == EXPERT_TOKENS_ROLE:
            self._on_expert_tokens(change)
            return
        if change.kind == ChangeKind.REMOVED:
            self._gone(change.node_id, "its etcd key was deleted (lease expired or revoked)")
            return
        try:
            info = common_pb2.NodeInfo.FromString(change.value)
        except DecodeError:
            info = None
        if info is None or (info.role, info.node_id) != (change.role, change.node_id) or node_info_error(info):
            log.warning("ignoring etcd key %s/%s: its value is not that node's NodeInfo (%s)",
                        change.role[:64], change.node_id[:128], node_info_error(info) if info else "does not parse")
            return
        member = self._members.get(info.node_id)
        if member is None or member.state == DOWN:
            self._join(info, self.default_ttl_s)
        else:
            member.info.CopyFrom(info)
            self._report(member)
