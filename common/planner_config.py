"""The meta-server's planner settings (section `meta_server.planner:` of a mesh config;
services/meta_server/planner.py is the planner, docs/planner.md the guide). common.config
re-exports it.

    enabled           false: no planner runs (the default); true: every interval_s the
                      meta-server computes the prefill and decode node counts the load needs
    interval_s        seconds between decisions, and the window whose load each one reads
    ttft_slo_ms       the time-to-first-token target the prefill pool is sized for
    itl_slo_ms        the inter-token-latency target the decode pool is sized for
    min_nodes, max_nodes   the counts stay within these, per role
    scale_down_after  a role shrinks by one node only after this many intervals in a row
                      that each wanted fewer
    cooldown_s        ... and never within this long of its last change
    profile           the JSON `pdmesh bench profile` wrote (one node's measured rates);
                      required when enabled; a relative path is relative to the meta-server's
                      working directory
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

SECTION = "meta_server.planner"


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) and math.isfinite(value)


@dataclass(frozen=True)
class PlannerConfig:
    enabled: bool = False
    interval_s: float = 30.0
    ttft_slo_ms: float = 1000.0
    itl_slo_ms: float = 100.0
    min_nodes: int = 1
    max_nodes: int = 8
    scale_down_after: int = 3
    cooldown_s: float = 120.0
    profile: str = ""

    def __post_init__(self) -> None:
        """ValueError naming the field (`meta_server.planner.FIELD`) and what it allows."""
        if not isinstance(self.enabled, bool):
            raise ValueError(f"{SECTION}.enabled must be true or false, got {self.enabled!r}")
        for name in ("interval_s", "ttft_slo_ms", "itl_slo_ms"):
            value = getattr(self, name)
            if not _is_number(value) or not value > 0:
                raise ValueError(f"{SECTION}.{name} must be > 0, got {value!r}")
        for name in ("min_nodes", "max_nodes", "scale_down_after"):
            if not _is_int(getattr(self, name)):
                raise ValueError(f"{SECTION}.{name} must be an integer, got {getattr(self, name)!r}")
        if not 0 <= self.min_nodes <= self.max_nodes:
            raise ValueError(f"{SECTION} needs 0 <= min_nodes <= max_nodes, got {self.min_nodes} "
                             f"and {self.max_nodes}")
        if self.scale_down_after < 1:
            raise ValueError(f"{SECTION}.scale_down_after must be >= 1, got {self.scale_down_after}")
        if not _is_number(self.cooldown_s) or self.cooldown_s < 0:
            raise ValueError(f"{SECTION}.cooldown_s must be >= 0, got {self.cooldown_s!r}")
        if not isinstance(self.profile, str):
            raise ValueError(f"{SECTION}.profile must be a file path, got {self.profile!r}")
        if self.enabled and not self.profile:
            raise ValueError(f"{SECTION}.profile is required when the planner is enabled: the JSON that "
                             "`pdmesh bench profile` writes (one node's measured prefill and decode rates)")

    @classmethod
    def from_dict(cls, raw: Any) -> "PlannerConfig":
        """The section as YAML gives it (a mapping, or None for the defaults); ValueError
        naming an unknown field and the allowed ones."""
        if raw is None:
            return cls()
        if isinstance(raw, cls):
            return raw
        if not isinstance(raw, dict):
            raise ValueError(f"{SECTION} must be a mapping, got {type(raw).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"{SECTION}: unknown field(s) {unknown}; allowed: {sorted(known)}")
        return cls(**raw)
