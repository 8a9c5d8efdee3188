"""What `pdmesh up --autoscale` does to follow the planner, as decisions without side
effects: the bounds per role, the pool of nodes it manages, and the actions that bring a
pool to the planner's count (services/cli/autoscaler.py carries them out).

A node's lifecycle under the autoscaler (NodeState, in order):

    STARTING   add_node: a new process loading its weights (from a live peer by default)
    SERVING    registered and routed to; counted in its pool
    DRAINING   MetaAdmin/DrainNode: nothing new is routed to it, what it holds finishes;
               back to SERVING (UndrainNode) when the planner wants it again first
    STOPPING   idle (`busy` empty) on polls DRAIN_SETTLE_S apart: SIGTERM, it deregisters
    (gone)     forgotten by `pdmesh up` and, by RemoveNode, by the meta-server

Scale-in only ever drains: a node leaves SERVING for DRAINING, never for STOPPING, and a
DRAINING node stops only once idle, however long that takes (a node still busy after
DRAIN_REPORT_S is reported, never killed).

Pools: the planner's roles. `prefill` holds the prefill nodes, `decode` the decode and
`both` nodes (the planner counts a colocated node as decode). A role given no bounds is
left alone. Counts stay within [min, max]; the config's nodes are in the pool from the
start and are drained after the ones the autoscaler started (newest first).
"""
from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Iterator

ROLES = ("prefill", "decode")
POOL_OF = {"prefill": "prefill", "decode": "decode", "both": "decode"}   # node role -> planner role
DRAIN_SETTLE_S = 1.0    # idle this long (two polls at least) before a drained node stops: a request
                        # routed just before the drain reaches the node a round trip later
DRAIN_REPORT_S = 60.0   # a node still busy this long after its drain gets one status line
# the EngineStats fields that must all be 0 for a node to stop: requests running or waiting,
# KV being filled from elsewhere, finished prefills held while pushed, KV pushes in flight,
# blocks a remote writer may still write
IDLE_FIELDS = ("running", "waiting", "kv_remote", "held", "pending_transfers", "quarantined_blocks")
_SPEC = re.compile(r"(\d+):(\d+)")


@dataclass(frozen=True)
class Bounds:
    min_nodes: int
    max_nodes: int

    def clamp(self, count: int) -> int:
        return min(max(count, self.min_nodes), self.max_nodes)

    def __str__(self) -> str:
        return f"{self.min_nodes}..{self.max_nodes}"


def parse_autoscale(text: str) -> dict[str, Bounds]:
    """`prefill=1:3,decode=1:3` -> {role: Bounds}; ValueError saying what is wrong and the
    allowed form. MIN may be 0 for prefill (decode nodes then prefill themselves), not for
    decode (the planner sizes a pool from the requests that ended, which no decode node
    means none)."""
    form = "ROLE=MIN:MAX[,ROLE=MIN:MAX] with ROLE prefill or decode, e.g. prefill=1:3,decode=1:3"
    items = [item.strip() for item in text.split(",")]
    if not text.strip() or not all(items):
        raise ValueError(f"--autoscale must be {form}, got {text!r}")
    bounds: dict[str, Bounds] = {}
    for item in items:
        role, eq, spec = (part.strip() for part in item.partition("="))
        if not eq:
            raise ValueError(f"--autoscale: {item!r} is not ROLE=MIN:MAX ({form})")
        if role not in ROLES:
            raise ValueError(f"--autoscale: role must be one of {', '.join(ROLES)}, got {role!r}")
        if role in bounds:
            raise ValueError(f"--autoscale: {role} is given twice")
        m = _SPEC.fullmatch(spec)
        if m is None:
            raise ValueError(f"--autoscale {role}: bounds must be MIN:MAX, two whole numbers, got {spec!r}")
        lo, hi = int(m[1]), int(m[2])
        if lo > hi or hi < 1:
            raise ValueError(f"--autoscale {role}: need MIN <= MAX and MAX >= 1, got {lo}:{hi}")
        if role == "decode" and lo < 1:
            raise ValueError("--autoscale decode: MIN must be >= 1 (the planner sizes the decode pool from "
                             f"requests that ended, and no decode node ends none), got {lo}:{hi}")
        bounds[role] = Bounds(lo, hi)
    return bounds


def check_autoscale(mesh_cfg, bounds: dict[str, Bounds]) -> None:
    """The mesh config can be autoscaled within bounds: its planner is on and it lists no
    more nodes of a role than the role's MAX. ValueError naming the field or the nodes."""
    if not mesh_cfg.meta.planner.enabled:
        raise ValueError("--autoscale follows the meta-server's planner: set meta_server.planner.enabled: "
                         "true (and meta_server.planner.profile, from `pdmesh bench profile`; docs/planner.md)")
    for role, b in bounds.items():
        listed = [n.node_id for n in mesh_cfg.nodes if POOL_OF[n.role] == role]
        if len(listed) > b.max_nodes:
            raise ValueError(f"--autoscale {role}={b.min_nodes}:{b.max_nodes}: the config lists {len(listed)} "
                             f"{role} nodes {listed}, more than MAX")


class NodeState(enum.IntEnum):
    STARTING = 1
    SERVING = 2
    DRAINING = 3
    STOPPING = 4


@dataclass
class PoolNode:
    """One node of a pool. seq orders joining (the config's nodes first, in its order)."""

    node_id: str
    role: str                           # the pool: prefill | decode
    from_config: bool
    seq: int
    state: NodeState = NodeState.SERVING
    drained_at: float = 0.0             # when DrainNode was sent (DRAINING, STOPPING)
    idle_since: float | None = None     # the first of the idle polls in a row since then
    reported: bool = False              # "still draining" said once

    @property
    def counted(self) -> bool:
        """In the pool's count: starting or serving (a draining node is on its way out)."""
        return self.state in (NodeState.STARTING, NodeState.SERVING)


@dataclass(frozen=True)
class Action:
    kind: str        # start | drain | undrain
    node_id: str
    role: str


def drain_order(node: PoolNode) -> tuple:
    """Drained first: the nodes the autoscaler started, newest first; then the config's,
    last listed first."""
    return node.from_config, -node.seq


def plan_role(role: str, desired: int | None, bounds: Bounds, nodes: list[PoolNode],
              new_ids: Iterator[str]) -> list[Action]:
    """The actions that take role's pool to `desired` within bounds (None: no decision yet,
    only the bounds). Growing undrains draining nodes first (the most recently drained
    first), then starts new ones named by new_ids. Shrinking drains (drain_order), never
    below bounds.min_nodes, and waits while a node of the pool is still starting (the
    planner does not count it yet). Changes nothing; the caller applies the actions."""
    pool = [n for n in nodes if n.role == role]
    counted = [n for n in pool if n.counted]
    target = bounds.clamp(len(counted) if desired is None else desired)
    if target > len(counted):
        need = target - len(counted)
        back = sorted((n for n in pool if n.state == NodeState.DRAINING), key=lambda n: -n.drained_at)[:need]
        return ([Action("undrain", n.node_id, role) for n in back]
                + [Action("start", next(new_ids), role) for _ in range(need - len(back))])
    if target < len(counted) and not any(n.state == NodeState.STARTING for n in counted):
        return [Action("drain", n.node_id, role) for n in sorted(counted, key=drain_order)[:len(counted) - target]]
    return []


def busy(stats) -> dict[str, int]:
    """The IDLE_FIELDS of an EngineStats that are not 0 (empty: the node is idle)."""
    return {name: getattr(stats, name) for name in IDLE_FIELDS if getattr(stats, name)}


def may_stop(node: PoolNode, work: dict[str, int] | None, now: float) -> bool:
    """Whether draining `node` may stop now, given its poll at `now`: `work` is busy() of
    its stats, None when it did not answer. True once it has been idle on every poll for
    DRAIN_SETTLE_S. Updates node.idle_since."""
    if work is None or work:
        node.idle_since = None
        return False
    if node.idle_since is None:
        node.idle_since = now
    return now - node.idle_since >= DRAIN_SETTLE_S


def describe_work(work: dict[str, int] | None) -> str:
    if work is None:
        return "no answer to GetEngineStats"
    return ", ".join(f"{value} {name.replace('_', ' ')}" for name, value in work.items())
