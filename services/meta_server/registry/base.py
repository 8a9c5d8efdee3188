"""The meta-server's node table: one interface, whatever feeds it.

    EmbeddedRegistry (embedded.py)  fed by the Register / Heartbeat / Deregister RPCs;
                                    a member is gone when it misses its TTL.
    EtcdRegistry (etcd.py)          follows the keys that nodes keep on their etcd leases;
                                    a member is gone when its key is deleted.
    create_registry (__init__.py)   the one place that picks: etcd when configured.

Lifecycle of a member, the same in both:
  joins -> up (each report replaces its load and resets its routed count)
  -> gone -> down: still listed (for operators), never routed to; joins again if it comes back
  -> down for `down_retention_ttls` TTLs -> forgotten
  remove (operator) forgets it at once; a live node joins again at its next report (TTL/3).
Every join calls `on_join(node_id)` (MetaControl sets it: the router empties the node's
prefix index). A Mixture-of-Experts node's expert counts are kept beside its member
(expert_tokens(node_id)), never in the NodeInfo that Route and ListMembers hand out; each
implementation says when they arrive and go. Time is
applied lazily: every look at the table (get, members, alive, heartbeat) first marks the
expired members down and forgets the long-down ones, by `clock`.

Thread-safety: used from the meta-server's event loop only.
"""
from __future__ import annotations

import abc
import logging
import time
from dataclasses import dataclass
from typing import Callable

from common.cluster.base import DEFAULT_TTL_S
from protos.pdmesh.v1 import common_pb2

log = logging.getLogger("pdmesh.meta")

UP, DOWN = "up", "down"


ExpertTokens = dict[int, list[int]]    # MoE layer index -> tokens per expert (by expert id)


def expert_tokens_of(message: common_pb2.ExpertTokens) -> ExpertTokens:
    """An ExpertTokens message as the registry keeps it (a layer given twice: the last)."""
    return {e.layer: list(e.num_tokens) for e in message.layers}


class RegistrationRefusedError(RuntimeError):
    """Nodes of this mesh do not register with the meta-server by RPC (the message says
    where they do)."""


class RegistrationConflictError(RuntimeError):
    """Another instance (process) holds this node_id while its lease is live."""


@dataclass
class Member:
    info: common_pb2.NodeInfo          # opaque to the registry; handed back by Route
    ttl_s: float
    last_seen: float                   # the last join or report, by the registry's clock
    instance_id: str = ""              # the process that joined (RPC registrations)
    routed_since_heartbeat: int = 0    # requests routed here since its last load report
    local_prefills_since_heartbeat: int = 0   # of those, the ones it prefills itself
    down_since: float | None = None    # set when it was found gone

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

    def prefill_backlog(self) -> int:
        """Prompts a prefill node has to compute: in prefill or waiting at the last
        heartbeat, plus routed to it since."""
        load = self.info.load
        return load.running + load.waiting + self.routed_since_heartbeat

    def local_prefill_backlog(self) -> int:
        """Prompts a decode node has to prefill itself, as far as the router knows: waiting
        for admission at the last heartbeat plus local prefills routed to it since."""
        return self.info.load.waiting + self.local_prefills_since_heartbeat


class Registry(abc.ABC):
    """Members by node id. Implementations feed the table through _join, _report, _gone
    and _forget (and may declare a time limit through _expired); reads are shared."""

    refusal = "this meta-server does not take registrations by RPC"

    def __init__(self, default_ttl_s: float = DEFAULT_TTL_S, down_retention_ttls: float = 10.0,
                 clock: Callable[[], float] = time.monotonic):
        self.default_ttl_s = default_ttl_s
        self.down_retention_ttls = down_retention_ttls
        self.clock = clock
        self.on_join: Callable[[str], None] | None = None   # set by the owner before start()
        self._members: dict[str, Member] = {}
        self._expert_tokens: dict[str, ExpertTokens] = {}   # node_id -> its last reported counts

    # ---- lifecycle ----------------------------------------------------------------
    @abc.abstractmethod
    async def start(self) -> None:
        """Begin following the source of membership; never raises because it is away."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop following; the table keeps its last view. Idempotent."""

    # ---- RPC-fed membership (optional: refused unless overridden) ---------------------
    def register(self, info: common_pb2.NodeInfo, instance_id: str = "") -> float:
        """Add or replace the member, up (a join); returns the TTL granted: always the
        registry's default_ttl_s (a node does not choose it). RegistrationConflictError
        when an up member of that node_id came from another instance;
        RegistrationRefusedError where nodes register elsewhere."""
        raise RegistrationRefusedError(self.refusal)

    def heartbeat(self, node_id: str, load: common_pb2.NodeLoad, instance_id: str = "",
                  expert_tokens: ExpertTokens | None = None) -> bool:
        """Report the load of an up member, and its expert counts when given (None: as
        last reported); False if unknown, down or joined by another instance (register
        again). RegistrationRefusedError where nodes register elsewhere."""
        raise RegistrationRefusedError(self.refusal)

    def deregister(self, node_id: str, instance_id: str = "") -> bool:
        """A node's clean shutdown: forget it at once; False if unknown.
        RegistrationConflictError when another instance joined it;
        RegistrationRefusedError where nodes register elsewhere."""
        raise RegistrationRefusedError(self.refusal)

    # ---- operator -----------------------------------------------------------------
    def remove(self, node_id: str) -> bool:
        """Forget the member, up or down; False if unknown. A live node joins again at
        its next report."""
        return self._forget(node_id)

    # ---- reads --------------------------------------------------------------------
    def get(self, node_id: str) -> Member | None:
        self._sweep()
        return self._members.get(node_id)

    def members(self) -> list[Member]:
        """Every listed member, up or down, in the order they joined."""
        self._sweep()
        return list(self._members.values())

    def alive(self) -> list[Member]:
        """Members that are up (routable unless drained)."""
        return [m for m in self.members() if m.state == UP]

    def expert_tokens(self, node_id: str) -> ExpertTokens:
        """The node's expert counts as last reported; {} for none (a dense model, or none
        reported yet). The caller must not mutate them."""
        return self._expert_tokens.get(node_id, {})

    def seconds_since_heartbeat(self, member: Member) -> float:
        """Since the member's last join or report."""
        return self.clock() - member.last_seen

    # ---- for implementations --------------------------------------------------------
    def _join(self, info: common_pb2.NodeInfo, ttl_s: float, instance_id: str = "") -> Member:
        member = Member(common_pb2.NodeInfo(), ttl_s, self.clock(), instance_id=instance_id)
        member.info.CopyFrom(info)
        self._members[info.node_id] = member
        log.info("node %s (%s) joined at %s", info.node_id, info.role, info.address)
        if self.on_join is not None:
            self.on_join(info.node_id)
        return member

    def _report(self, member: Member) -> None:
        """The member's info was just refreshed by its node."""
        member.last_seen = self.clock()
        member.routed_since_heartbeat = 0
        member.local_prefills_since_heartbeat = 0

    def _gone(self, node_id: str, why: str) -> bool:
        """Mark an up member down; False if unknown or already down."""
        member = self._members.get(node_id)
        if member is None or member.down_since is not None:
            return False
        member.down_since = self.clock()
        log.info("node %s is down: %s", node_id, why)
        return True

    def _forget(self, node_id: str) -> bool:
        return self._members.pop(node_id, None) is not None

    def _expired(self, member: Member, now: float) -> bool:
        """Whether an up member is gone by time alone. Optional: never by default (the
        source says when a member is gone)."""
        return False

    def _sweep(self) -> None:
        now = self.clock()
        for m in list(self._members.values()):
            if m.down_since is None:
                if self._expired(m, now):
                    self._gone(m.node_id, f"no heartbeat for {now - m.last_seen:.1f}s (ttl {m.ttl_s:g}s)")
            elif now - m.down_since > self.down_retention_ttls * min(m.ttl_s, self.default_ttl_s):
                del self._members[m.node_id]
                self._expert_tokens.pop(m.node_id, None)
