"""How many prefill and decode nodes the load needs: the planner's formula, hysteresis and
cool-down (issue 31's planner; Dynamo's SLA planner formulas as the start).

Every interval the meta-server gives `Planner.decide` one LoadSample (what the interval
brought: requests, their mean prompt and output lengths, the share of prompt tokens the
caches served, the prefill queue, the observed TTFT and ITL, the nodes serving now) and
gets a PlannerDecision: the node counts to run, the counts the formula wanted before the
hysteresis, and one line per role saying why.

    prompt left   isl = mean_prompt_tokens x (1 - prefix_hit_rate)       (what prefill computes)
    prefill       demand = requests x isl / interval_s                   (tokens/s)
                  rate = profile.prefill_rate(isl) / correction            (tokens/s a node)
                  correction = observed TTFT / the TTFT the profile predicts with the queue
                  the nodes had (service + queue_tokens / (rate x nodes)), within [0.25, 4]
                  P = max(ceil(demand / rate),                               throughput
                          ceil(queue_tokens / (rate x (ttft_slo - service))))  the queue drained
                  service = profile.prefill_ttft(isl) x correction (one prompt, idle node);
                  when service >= ttft_slo no node count meets the SLO: max_nodes, said so
    decode        context = isl_full + mean_output_tokens / 2 (the mean context while decoding)
                  correction = observed ITL / profile ITL at the batch a node carried
                  rate = profile.decode_rate(itl_slo / correction, context)  (tokens/s a node)
                  D = ceil(requests x mean_output_tokens / interval_s / rate)

Hysteresis: a role grows at once to what it needs; it shrinks by one node only after
`scale_down_after` intervals in a row that each wanted fewer, and never within `cooldown_s`
of its last change (a new node needs time to warm its caches; shrinking and growing again
costs a model load). Counts stay within [min_nodes, max_nodes] per role.

The profile (NodeProfile) is what one node of the hardware does: prefill TTFT and
throughput at a few prompt lengths, decode ITL at a few (context, batch) points; linear
interpolation between points, the end points held beyond them.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

from common.planner_config import PlannerConfig  # noqa: F401  (the settings; re-exported)

ROLES = ("prefill", "decode")
CORRECTION_RANGE = (0.25, 4.0)   # observed / profiled: beyond it one interval says more about noise


def _clamp(correction: float) -> float:
    return min(max(correction, CORRECTION_RANGE[0]), CORRECTION_RANGE[1])


def _interp(points: list[tuple[float, float]], x: float) -> float:
    """Piecewise-linear y(x) through points sorted by x; the end values held outside them."""
    xs = [p[0] for p in points]
    i = bisect.bisect_left(xs, x)
    if i == 0:
        return points[0][1]
    if i == len(points):
        return points[-1][1]
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class NodeProfile:
    """prefill: (prompt tokens, TTFT s on an idle node, tokens/s at full load) points;
    decode: (context tokens, batch, ITL s) points (throughput = batch / ITL)."""

    prefill: tuple[tuple[int, float, float], ...]
    decode: tuple[tuple[int, int, float], ...]

    def __post_init__(self) -> None:
        if not self.prefill or not self.decode:
            raise ValueError("a node profile needs at least one prefill and one decode point")
        if any(t <= 0 or r <= 0 for _, t, r in self.prefill) or any(b < 1 or itl <= 0 for _, b, itl in self.decode):
            raise ValueError("profile points need TTFT, rate and ITL > 0 and batch >= 1")

    def prefill_ttft(self, isl: float) -> float:
        return _interp(sorted((p[0], p[1]) for p in self.prefill), isl)

    def prefill_rate(self, isl: float) -> float:
        return _interp(sorted((p[0], p[2]) for p in self.prefill), isl)

    def _contexts(self) -> list[int]:
        return sorted({c for c, _, _ in self.decode})

    def _at_context(self, context: int) -> list[tuple[int, float]]:
        return sorted((b, itl) for c, b, itl in self.decode if c == context)

    def decode_itl(self, context: float, batch: float) -> float:
        """ITL at (context, batch): interpolated in batch at the two measured contexts around
        context, then in context."""
        return _interp([(c, _interp([(b, t) for b, t in self._at_context(c)], batch)) for c in self._contexts()],
                       context)

    def decode_rate(self, itl_target_s: float, context: float) -> float:
        """The most tokens/s a node decodes at context with ITL <= itl_target_s: the largest
        batch (interpolated between measured batches) whose ITL meets it, times 1 / ITL; at
        least the smallest measured batch's rate (the target may be unmeetable)."""
        batches = sorted({b for _, b, _ in self.decode})
        best = 1 / self.decode_itl(context, batches[0]) * batches[0]
        for lo, hi in zip(batches, batches[1:]):
            t_lo, t_hi = self.decode_itl(context, lo), self.decode_itl(context, hi)
            if t_hi <= itl_target_s:
                best = max(best, hi / t_hi)
            elif t_lo <= itl_target_s < t_hi:
                b = lo + (hi - lo) * (itl_target_s - t_lo) / (t_hi - t_lo)
                best = max(best, b / itl_target_s)
        return best


@dataclass(frozen=True)
class LoadSample:
    """One interval's load, as the meta-server saw it."""

    requests: int
    mean_prompt_tokens: float
    mean_output_tokens: float
    prefix_hit_rate: float = 0.0        # share of prompt tokens the caches served
    prefill_queue_tokens: int = 0       # prompt tokens waiting for a prefill at the end
    observed_ttft_s: float | None = None
    observed_itl_s: float | None = None
    prefill_nodes: int = 1
    decode_nodes: int = 1


@dataclass(frozen=True)
class PlannerDecision:
    nodes: dict[str, int]             # what to run now, per role
    wanted: dict[str, int]            # the formula's counts, before hysteresis and limits
    reasons: dict[str, str]           # one line per role


@dataclass
class Planner:
    cfg: PlannerConfig
    profile: NodeProfile
    _below: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ROLES, 0))
    _changed_at: dict[str, float] = field(default_factory=lambda: dict.fromkeys(ROLES, -math.inf))

    def wanted(self, s: LoadSample) -> tuple[dict[str, int], dict[str, str]]:
        """The formula's node counts and why (module docstring), no hysteresis."""
        cfg, prof = self.cfg, self.profile
        isl = s.mean_prompt_tokens * (1 - s.prefix_hit_rate)
        rate_0, service_0 = prof.prefill_rate(isl), prof.prefill_ttft(isl)
        p_corr = 1.0
        if s.observed_ttft_s and s.requests:   # against the TTFT the profile predicts with that queue
            expected = service_0 + s.prefill_queue_tokens / (rate_0 * max(s.prefill_nodes, 1))
            p_corr = _clamp(s.observed_ttft_s / expected)
        rate_p, service = rate_0 / p_corr, service_0 * p_corr
        demand = s.requests * isl / cfg.interval_s
        p_rate = math.ceil(demand / rate_p)
        slack = cfg.ttft_slo_ms / 1e3 - service
        if slack <= 0:
            p_queue, queue_why = cfg.max_nodes, (f"one {isl:.0f}-token prefill takes {service * 1e3:.0f} ms >= the "
                                                 f"TTFT SLO {cfg.ttft_slo_ms:.0f} ms: no node count meets it")
        else:
            p_queue = math.ceil(s.prefill_queue_tokens / (rate_p * slack))
            queue_why = f"{s.prefill_queue_tokens} queued tokens drained within {slack * 1e3:.0f} ms"
        prefill = max(p_rate, p_queue)
        context = s.mean_prompt_tokens + s.mean_output_tokens / 2
        d_corr = 1.0
        if s.observed_itl_s and s.requests and s.decode_nodes:
            # concurrent decodes a node carried (Little's law): arrivals/s x decode time / nodes
            batch = s.requests / cfg.interval_s * s.mean_output_tokens * s.observed_itl_s / s.decode_nodes
            d_corr = _clamp(s.observed_itl_s / prof.decode_itl(context, max(batch, 1.0)))
        rate_d = prof.decode_rate(cfg.itl_slo_ms / 1e3 / d_corr, context)
        decode = math.ceil(s.requests * s.mean_output_tokens / cfg.interval_s / rate_d)
        reasons = {
            "prefill": (f"{demand:.0f} prompt tokens/s (isl {isl:.0f} after a {s.prefix_hit_rate:.0%} hit rate) at "
                        f"{rate_p:.0f} tokens/s a node (correction {p_corr:.2f}): {p_rate}; {queue_why}: {p_queue}"),
            "decode": (f"{s.requests * s.mean_output_tokens / cfg.interval_s:.0f} output tokens/s at {rate_d:.0f} "
                       f"tokens/s a node for ITL {cfg.itl_slo_ms:.0f} ms at context {context:.0f} (correction "
                       f"{d_corr:.2f}): {decode}"),
        }
        return {"prefill": prefill, "decode": decode}, reasons

    def decide(self, s: LoadSample, now: float) -> PlannerDecision:
        """The counts to run after this interval (hysteresis and cool-down, module
        docstring); now: a monotonic clock's seconds."""
        wanted, reasons = self.wanted(s)
        current = {"prefill": s.prefill_nodes, "decode": s.decode_nodes}
        nodes = {}
        for role in ROLES:
            want = min(max(wanted[role], self.cfg.min_nodes), self.cfg.max_nodes)
            have = current[role]
            cooling = now - self._changed_at[role] < self.cfg.cooldown_s
            self._below[role] = self._below[role] + 1 if want < have else 0
            if want > have:
                nodes[role] = want
            elif want < have and self._below[role] >= self.cfg.scale_down_after and not cooling:
                nodes[role] = have - 1
            else:
                nodes[role] = have
                if want < have:
                    reasons[role] += (f"; kept {have}: cooling down" if cooling else
                                      f"; kept {have}: {self._below[role]} of {self.cfg.scale_down_after} "
                                      "intervals below")
            if nodes[role] != have:
                self._changed_at[role] = now
                self._below[role] = 0
        return PlannerDecision(nodes=nodes, wanted=wanted, reasons=reasons)
