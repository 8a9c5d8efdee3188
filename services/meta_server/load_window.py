"""What the gateways reported since the planner's last decision: sums over the client
requests that ended (pdmesh.v1.MetaServer/ReportRequests), added as they come and taken
whole once an interval (services/meta_server/planner_loop.py).

A report is checked before it counts (a mesh member sent it, but a bug must not poison the
planner): every count an integer in [0, MAX_COUNT], every sum finite and in [0,
MAX_SECONDS], first tokens <= requests, token gaps <= output tokens; else ValueError naming
the field (INVALID_ARGUMENT at the servicer) and nothing is added.

Thread-safety: the meta-server's event loop only.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

MAX_COUNT = 1 << 40            # requests or tokens in one report: far above any gateway's seconds
MAX_SECONDS = 1e12             # a sum of latencies (1 << 40 requests of ~1 s each)


@dataclass
class RequestTotals:
    """Sums over ended requests (the fields of ReportRequestsRequest)."""

    num_requests: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    num_first_tokens: int = 0
    ttft_s_sum: float = 0.0
    num_token_gaps: int = 0
    token_gaps_s_sum: float = 0.0

    def add(self, other: "RequestTotals") -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    @property
    def mean_prompt_tokens(self) -> float:
        return self.prompt_tokens / self.num_requests if self.num_requests else 0.0

    @property
    def mean_output_tokens(self) -> float:
        return self.output_tokens / self.num_requests if self.num_requests else 0.0

    @property
    def mean_ttft_s(self) -> float | None:
        """None when no request got a first token."""
        return self.ttft_s_sum / self.num_first_tokens if self.num_first_tokens else None

    @property
    def mean_itl_s(self) -> float | None:
        """Token-weighted: every gap between two tokens of a request counts once. None
        when no request had two tokens."""
        return self.token_gaps_s_sum / self.num_token_gaps if self.num_token_gaps else None


COUNTS = ("num_requests", "prompt_tokens", "output_tokens", "num_first_tokens", "num_token_gaps")
SUMS = ("ttft_s_sum", "token_gaps_s_sum")


def totals_from_report(report) -> RequestTotals:
    """A ReportRequestsRequest (or anything with its fields) as RequestTotals; ValueError
    naming the field (module docstring)."""
    for name in COUNTS:
        value = getattr(report, name)
        if not 0 <= value <= MAX_COUNT:
            raise ValueError(f"{name} must be in [0, {MAX_COUNT}], got {value}")
    for name in SUMS:
        value = getattr(report, name)
        if not (math.isfinite(value) and 0 <= value <= MAX_SECONDS):
            raise ValueError(f"{name} must be a finite number of seconds in [0, {MAX_SECONDS:g}], got {value}")
    if report.num_first_tokens > report.num_requests:
        raise ValueError(f"num_first_tokens ({report.num_first_tokens}) must be <= num_requests "
                         f"({report.num_requests})")
    if report.num_token_gaps > report.output_tokens:
        raise ValueError(f"num_token_gaps ({report.num_token_gaps}) must be <= output_tokens "
                         f"({report.output_tokens})")
    return RequestTotals(**{name: getattr(report, name) for name in (*COUNTS, *SUMS)})


class LoadWindow:
    """Reports summed since the last take()."""

    def __init__(self):
        self._totals = RequestTotals()
        self.num_reports = 0

    def add(self, totals: RequestTotals) -> None:
        self._totals.add(totals)
        self.num_reports += 1

    def take(self) -> RequestTotals:
        """The sums so far; the window starts empty again."""
        totals, self._totals = self._totals, RequestTotals()
        return totals
