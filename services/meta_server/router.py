"""Routing: pick the decode node and the prefill node (or local prefill) of a request.

least_load: the node with the lowest (running + waiting + routed since its last heartbeat
+ fraction of blocks used); ties broken by node id. round_robin: in turn by node id.
A `both` node serves the whole request itself. Prefill is local when there is no
prefill node, or the prompt is shorter than `local_prefill_max_tokens`.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from services.meta_server.registry import Member


class NoNodeError(LookupError):
    """No live node can take the request."""


@dataclass
class RouteDecision:
    decode: Member
    prefill: Member | None

    @property
    def local_prefill(self) -> bool:
        return self.prefill is None


class Router:
    def __init__(self, policy: str = "least_load", local_prefill_max_tokens: int = 0):
        self.policy = policy
        self.local_prefill_max_tokens = local_prefill_max_tokens
        self._turns = itertools.count()
        self.num_routed = 0

    def _pick(self, candidates: list[Member]) -> Member:
        candidates.sort(key=lambda m: m.node_id)
        if self.policy == "round_robin":
            return candidates[next(self._turns) % len(candidates)]
        return min(candidates, key=lambda m: (m.load_score(), m.node_id))

    def route(self, members: list[Member], model_id: str, num_prompt_tokens: int,
              exclude: set[str] = frozenset()) -> RouteDecision:
        usable = [m for m in members if m.node_id not in exclude
                  and (not model_id or m.info.model_id == model_id)]
        decodes = [m for m in usable if m.role in ("decode", "both")]
        if not decodes:
            raise NoNodeError(f"no live decode node for model {model_id!r}")
        decode = self._pick(decodes)
        prefill = None
        prefills = [m for m in usable if m.role == "prefill"]
        if decode.role == "decode" and prefills and num_prompt_tokens >= self.local_prefill_max_tokens:
            prefill = self._pick(prefills)
        for m in (decode, prefill):
            if m is not None:
                m.routed_since_heartbeat += 1
                m.num_routed += 1
        self.num_routed += 1
        return RouteDecision(decode, prefill)
