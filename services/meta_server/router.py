"""Routing: pick the decode node and the prefill node (or local prefill) of a request.

Candidates are the live members serving the model, minus drained nodes, stalled ones
(their step loop reported no progress: NodeLoad.stalled) and the request's excluded ones
(nodes that already failed it). Policies, per tier (decode, prefill):
  round_robin  in turn by node id, one turn counter per tier.
  least_load   lowest Member.load_score() (running + waiting at the last heartbeat +
               routed since + fraction of blocks used); ties by node id.
  cache_aware  Dynamo-style cost, lowest wins, ties by node id:
                   cost = (num request blocks - prefix hit blocks) + load_penalty_blocks * load_score
               i.e. the blocks the node would have to prefill plus a load penalty in block
               units (default: one request in flight weighs 4 blocks). With a 512-token
               shared prefix (32 blocks of 16) the node that served it wins unless it
               has about 8 more requests in flight than the others.

With a kv-store, its leading hits (one Lookup per request, services/meta_server/store_hits.py)
count as a hit on every prefill node: the prefix is then a read away wherever the request
goes, so the load penalty decides among them.

Where prefix hits come from: the gateway sends the request's block hashes (the chain of
common.hashing) in RouteRequest, and the router records them for the nodes it chose in a
PrefixIndex (per node LRU bounded by its number of KV blocks). Chosen over nodes
reporting prefix-cache events with heartbeats because it needs no engine hooks and sees a
prefix the moment it is routed (a report would lag up to TTL/3); the price is that
evictions are guessed (LRU bound), not observed, and the index is empty after a
meta-server restart. A wrong guess only costs a prefill; nodes check their own cache.
The index is kept under every policy, so switching to cache_aware starts warm.

Conditional disaggregation: prefill runs on the decode node (local) when the decode node
is a `both` node, there is no usable prefill node, the prompt is shorter than
local_prefill_max_tokens, or prefill_queue_threshold > 0 and every usable prefill node's
backlog exceeds the decode node's own by more than the threshold. A backlog counts what
the last heartbeat reported plus what the router sent since (a burst is routed within
milliseconds, long before the next heartbeat), so under overload the prompts split
between the prefill tier and the decode node's spare compute (join the shorter queue),
and at light load every prompt still goes to the prefill tier.

Tensor parallelism: only prefill nodes whose TP size and per-rank KV heads can push into
the chosen decode node are candidates (common/transfer/tp_pairing.py: prefill TP = decode
TP, or a multiple of it); when every prefill node is refused that way the decode node
prefills locally, and the router logs why (once per pair of sizes) and counts it
(num_tp_refused), so a mesh of mismatched sizes serves instead of hanging.

Thread-safety: event loop only; route() mutates counters, the index and the chosen
members' routed_since_heartbeat.
"""
from __future__ import annotations

import itertools
import logging
from collections import Counter
from dataclasses import dataclass, field

from common.config import POLICIES
from common.kv_layout import LATENT_KINDS
from common.transfer.tp_pairing import pairing_refusal
from services.meta_server.prefix_index import PrefixIndex
from services.meta_server.registry import Member


log = logging.getLogger("pdmesh.meta")


class NoNodeError(LookupError):
    """No live node can take the request."""


@dataclass(frozen=True)
class RouteRequest:
    model_id: str
    num_prompt_tokens: int
    block_hashes: tuple[bytes, ...] = ()
    exclude_node_ids: frozenset[str] = frozenset()
    store_hit_blocks: int = 0          # leading blocks the kv-store holds (any prefill node reads them)


@dataclass
class RouteDecision:
    decode: Member
    prefill: Member | None
    num_hit_blocks: int = 0            # predicted prefix hit on the decode node
    prefill_fallbacks: list[Member] = field(default_factory=list)  # the other prefill nodes, best first

    @property
    def local_prefill(self) -> bool:
        return self.prefill is None


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {list(POLICIES)}, got {policy!r}")
    return policy


class Router:
    def __init__(self, local_prefill_max_tokens: int = 0, prefill_queue_threshold: int = 0,
                 load_penalty_blocks: float = 4.0):
        self.local_prefill_max_tokens = local_prefill_max_tokens
        self.prefill_queue_threshold = prefill_queue_threshold
        self.load_penalty_blocks = load_penalty_blocks
        self.index = PrefixIndex()
        self._turns = {"decode": itertools.count(), "prefill": itertools.count()}
        self.num_routed = 0
        self.num_local_prefill = 0
        # prompt blocks routed, and of those the ones the prefilling node was predicted to
        # hold (its PrefixIndex): the router's prefix hit rate (dashboard)
        self.num_query_blocks = self.num_hit_blocks = 0
        # prompt tokens routed, and of those the ones a cache was predicted to hold (the
        # prefilling node's index, or the kv-store's leading hits): the planner's hit rate
        self.num_prompt_tokens_routed = self.num_hit_tokens_routed = 0
        self.routed_by_node: Counter[str] = Counter()
        self.node_roles: dict[str, str] = {}
        self.num_tp_refused = 0            # requests prefilled locally: no prefill node's TP fits
        self._tp_refusals_logged: set[tuple] = set()     # (p, heads_p, d, heads_d, kind_p, kind_d)

    def route(self, members: list[Member], request: RouteRequest, policy: str,
              drained: frozenset[str] = frozenset()) -> RouteDecision:
        """Choose among `members` (the live ones); NoNodeError if no decode node fits."""
        check_policy(policy)
        skip = drained | request.exclude_node_ids
        usable = [m for m in members if m.node_id not in skip and not m.info.load.stalled
                  and (not request.model_id or m.info.model_id == request.model_id)]
        decodes = [m for m in usable if m.role in ("decode", "both")]
        if not decodes:
            raise NoNodeError(f"no live, undrained decode node for model {request.model_id!r}")
        hashes = request.block_hashes
        decode = self._pick("decode", decodes, policy, hashes)
        every_prefill = [m for m in usable if m.role == "prefill"]
        prefills = self._tp_compatible(decode, every_prefill)
        if every_prefill and not prefills and decode.role == "decode" \
                and request.num_prompt_tokens >= self.local_prefill_max_tokens:
            self.num_tp_refused += 1   # prefilled locally only because no prefill node's TP (or latent kind) fits
        ranked: list[Member] = []
        if decode.role == "decode" and prefills and not self._prefill_locally(request, decode, prefills):
            ranked = self._rank("prefill", prefills, policy, hashes, request.store_hit_blocks)
        decision = RouteDecision(decode, ranked[0] if ranked else None,
                                 self.index.prefix_hit(decode.node_id, hashes), ranked[1:])
        self._record(decision, request)
        return decision

    def _tp_compatible(self, decode: Member, prefills: list[Member]) -> list[Member]:
        """The prefill nodes that can push into decode across their TP sizes."""
        if decode.role != "decode" or not prefills:
            return prefills
        d, heads_d = tp_shape(decode)
        fit = []
        for m in prefills:
            p, heads_p = tp_shape(m)
            kind_p, kind_d = cache_kind(m), cache_kind(decode)
            refusal = (f"its KV cache is {kind_p}, the decode node's {kind_d}" if kind_p != kind_d else
                       pairing_refusal(p, heads_p, d, heads_d, kind_d in LATENT_KINDS))
            if refusal is None:
                fit.append(m)
            elif (p, heads_p, d, heads_d, kind_p, kind_d) not in self._tp_refusals_logged:
                self._tp_refusals_logged.add((p, heads_p, d, heads_d, kind_p, kind_d))
                log.warning("prefill node %s cannot push into decode node %s: %s; such pairs are never routed",
                            m.node_id, decode.node_id, refusal)
        return fit

    def _prefill_locally(self, request: RouteRequest, decode: Member, prefills: list[Member]) -> bool:
        if request.num_prompt_tokens < self.local_prefill_max_tokens:
            return True
        threshold = self.prefill_queue_threshold
        return threshold > 0 and (min(m.prefill_backlog() for m in prefills)
                                  > decode.local_prefill_backlog() + threshold)

    def _pick(self, tier: str, candidates: list[Member], policy: str,
              hashes: tuple[bytes, ...], shared_hit_blocks: int = 0) -> Member:
        return self._rank(tier, candidates, policy, hashes, shared_hit_blocks)[0]

    def _rank(self, tier: str, candidates: list[Member], policy: str,
              hashes: tuple[bytes, ...], shared_hit_blocks: int = 0) -> list[Member]:
        """Every candidate, the policy's choice first (round_robin: the turn's node, then
        the next ones in id order; the others: by their key)."""
        candidates = sorted(candidates, key=lambda m: m.node_id)
        if policy == "round_robin":
            turn = next(self._turns[tier]) % len(candidates)
            return candidates[turn:] + candidates[:turn]
        if policy == "cache_aware":
            return sorted(candidates, key=lambda m: (self.cost(m, hashes, shared_hit_blocks), m.node_id))
        return sorted(candidates, key=lambda m: (m.load_score(), m.node_id))

    def cost(self, member: Member, hashes: tuple[bytes, ...], shared_hit_blocks: int = 0) -> float:
        """cache_aware cost in blocks: blocks to prefill + load penalty. shared_hit_blocks
        is a hit every candidate has (the kv-store's). Read-only."""
        hit = max(self.index.prefix_hit(member.node_id, hashes), shared_hit_blocks)
        return (len(hashes) - hit) + self.load_penalty_blocks * member.load_score()

    def _record(self, decision: RouteDecision, request: RouteRequest) -> None:
        hashes = request.block_hashes
        prefiller = decision.prefill or decision.decode     # its predicted hit, before recording
        hit_blocks = self.index.prefix_hit(prefiller.node_id, hashes)
        self.num_query_blocks += len(hashes)
        self.num_hit_blocks += hit_blocks
        if decision.prefill is not None:   # the kv-store's blocks are a read away for a prefill node
            hit_blocks = max(hit_blocks, request.store_hit_blocks)
        self.num_prompt_tokens_routed += request.num_prompt_tokens
        self.num_hit_tokens_routed += min(hit_blocks * prefiller.info.kv_layout.block_size,
                                          request.num_prompt_tokens)
        for m in (decision.decode, decision.prefill):
            if m is not None:
                m.routed_since_heartbeat += 1
                self.routed_by_node[m.node_id] += 1
                self.node_roles[m.node_id] = m.role
                self.index.record(m.node_id, hashes, m.info.kv_layout.num_blocks)
        self.num_routed += 1
        self.num_local_prefill += decision.local_prefill
        if decision.local_prefill:
            decision.decode.local_prefills_since_heartbeat += 1

    def node_restarted(self, node_id: str) -> None:
        """A (re-)registered node starts with an empty prefix cache."""
        self.index.forget(node_id)

    def forget(self, node_id: str) -> None:
        """Drop the node's prefix index and routed count (RemoveNode)."""
        self.index.forget(node_id)
        self.routed_by_node.pop(node_id, None)
        self.node_roles.pop(node_id, None)


def cache_kind(member: Member) -> str:
    """Its KV layout's kind ("kv" for a node from before the field). An MLA model's node
    (a latent kind) holds the same latent on every rank: any TP pairs with any of one kind."""
    return member.info.kv_layout.kind or "kv"


def tp_shape(member: Member) -> tuple[int, int]:
    """(TP size, KV heads per rank) of a member, from its NodeInfo."""
    return max(member.info.tensor_parallel_size, 1), member.info.kv_layout.num_kv_heads
