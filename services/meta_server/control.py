"""The meta-server's logic behind both of its gRPC services: membership (a Registry,
embedded or etcd), routing (router) and operator state (AdminState), kept consistent
with each other.

Node states seen by operators: up | draining (up and drained) | down (gone, listed for
a while, see registry/base.py). Decisions:
  - drain/undrain need a known node id (UnknownNodeError otherwise), except that undrain
    also accepts an id only the admin state remembers (e.g. drained before a restart);
    the drained flag is kept by id, so a drained node that restarts stays drained.
  - remove forgets the node everywhere (membership, drained flag, routed count, prefix
    index). If it is alive, it joins again at its next report (embedded: its heartbeat
    is refused and it registers again): it comes back up, undrained, with an empty
    prefix index. To keep a live node out of service, drain it instead.
  - deregister (a node's clean shutdown, embedded registry) forgets membership only.
  - every join resets the node's prefix index (its cache starts empty).

Thread-safety: event loop only. Mutating methods are the async ones plus register,
heartbeat, deregister and route.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from common.config import POLICIES
from protos.pdmesh.v1 import common_pb2
from services.meta_server.admin_state import AdminState
from services.meta_server.registry import UP, ExpertTokens, Member, Registry
from services.meta_server.router import RouteDecision, Router, RouteRequest, check_policy

ROLE_ORDER = {"prefill": 0, "decode": 1, "both": 2}


class UnknownNodeError(KeyError):
    """No node of that id is known (never registered, removed, or long gone)."""

    def __str__(self) -> str:
        return f"no node {self.args[0]!r} is known to the meta-server"


@dataclass(frozen=True)
class NodeStatus:
    info: common_pb2.NodeInfo          # opaque here; load is the last heartbeat's
    state: str                         # up | draining | down
    seconds_since_heartbeat: float
    num_routed: int
    # a MoE node's expert counts as last reported (kept beside the member, not in info)
    expert_tokens: ExpertTokens = field(default_factory=dict)


@dataclass(frozen=True)
class ClusterStats:
    policy: str
    num_routed: int
    num_local_prefill: int
    routed_by_node: tuple[tuple[str, str, int], ...]   # (node_id, role, num_routed) by id
    free_blocks: int
    total_blocks: int


class MetaControl:
    def __init__(self, registry: Registry, router: Router, admin: AdminState):
        self.registry, self.router, self.admin = registry, router, admin
        registry.on_join = router.node_restarted     # a node that joins starts with an empty cache
        self.election = None            # a LeaderElection when several meta-servers share etcd
        self.candidate_id = ""
        self.leader_ready = True        # False while a new leader reloads the admin state
        self.take_over_task = None
        self.planner = None             # a PlannerLoop when meta_server.planner is enabled (server.py)
        # (node_id, role, policy) -> requests routed there under that policy; never
        # forgotten (Prometheus counters: services/meta_server/metrics.py)
        self.routed_total: Counter[tuple[str, str, str]] = Counter()

    # ---- membership ---------------------------------------------------------------
    def standby_reason(self) -> str | None:
        """Why this meta-server must not route (a standby of an elected leader), or None."""
        election = self.election
        if election is None:
            return None
        if election.is_leader:
            return None if self.leader_ready else f"meta-server {self.candidate_id} is taking over; retry"
        if election.was_leader:
            return None  # led when etcd went away: keep routing on the last view meanwhile
        return f"meta-server {self.candidate_id} is a standby; another meta-server leads"

    def register(self, info: common_pb2.NodeInfo, instance_id: str = "") -> float:
        """Returns the TTL granted. RegistrationRefusedError where nodes register in etcd;
        RegistrationConflictError when another live process holds the node_id."""
        return self.registry.register(info, instance_id)

    def heartbeat(self, node_id: str, load: common_pb2.NodeLoad, instance_id: str = "",
                  expert_tokens: ExpertTokens | None = None) -> bool:
        return self.registry.heartbeat(node_id, load, instance_id, expert_tokens)

    def deregister(self, node_id: str, instance_id: str = "") -> None:
        """RegistrationRefusedError where nodes register in etcd; RegistrationConflictError
        when another live process holds the node_id."""
        self.registry.deregister(node_id, instance_id)

    def route(self, request: RouteRequest) -> RouteDecision:
        policy = self.admin.policy()
        decision = self.router.route(self.registry.alive(), request, policy, self.admin.drained_node_ids())
        for m in (decision.decode, decision.prefill):
            if m is not None:
                self.routed_total[(m.node_id, m.role, policy)] += 1
        return decision

    def live_members(self) -> list[Member]:
        return self.registry.alive()

    # ---- operator view ------------------------------------------------------------
    def _status(self, m: Member) -> NodeStatus:
        state = m.state
        if state == UP and m.node_id in self.admin.drained_node_ids():
            state = "draining"
        return NodeStatus(m.info, state, self.registry.seconds_since_heartbeat(m),
                          self.router.routed_by_node.get(m.node_id, 0), self.registry.expert_tokens(m.node_id))

    def list_nodes(self) -> list[NodeStatus]:
        members = sorted(self.registry.members(), key=lambda m: (ROLE_ORDER.get(m.role, 9), m.node_id))
        return [self._status(m) for m in members]

    def _member(self, node_id: str) -> Member:
        member = self.registry.get(node_id)
        if member is None:
            raise UnknownNodeError(node_id)
        return member

    async def drain(self, node_id: str) -> NodeStatus:
        member = self._member(node_id)
        await self.admin.set_drained(node_id, True)
        return self._status(member)

    async def undrain(self, node_id: str) -> NodeStatus | None:
        """None when only the admin state knew the node (it is not registered now)."""
        member = self.registry.get(node_id)
        if member is None and node_id not in self.admin.drained_node_ids():
            raise UnknownNodeError(node_id)
        await self.admin.set_drained(node_id, False)
        return None if member is None else self._status(member)

    async def remove(self, node_id: str) -> None:
        known = self.registry.get(node_id) is not None
        if not known and node_id not in self.admin.drained_node_ids():
            raise UnknownNodeError(node_id)
        await self.admin.set_drained(node_id, False)      # first: it may fail, changing nothing
        self.registry.remove(node_id)
        self.router.forget(node_id)

    def policy(self) -> str:
        return self.admin.policy()

    async def set_policy(self, policy: str) -> str:
        """ValueError naming the allowed policies when unknown."""
        await self.admin.set_policy(check_policy(policy))
        return policy

    @staticmethod
    def allowed_policies() -> list[str]:
        return list(POLICIES)

    def stats(self) -> ClusterStats:
        roles = self.router.node_roles
        counts = sorted(self.router.routed_by_node.items())
        live = self.registry.alive()
        return ClusterStats(
            policy=self.admin.policy(), num_routed=self.router.num_routed,
            num_local_prefill=self.router.num_local_prefill,
            routed_by_node=tuple((node_id, roles.get(node_id, ""), n) for node_id, n in counts),
            free_blocks=sum(m.info.load.free_blocks for m in live),
            total_blocks=sum(m.info.load.total_blocks for m in live))
