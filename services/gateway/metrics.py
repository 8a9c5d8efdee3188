"""The gateway's Prometheus metrics, per client request (common/metrics.py serves them).

Measured where every public request passes, RequestStream.replies (gRPC and HTTP alike),
from the request's arrival at the gateway (before tokenization):
  time_to_first_token_seconds   arrival -> the first reply with tokens
  time_per_output_token_seconds per request of >= 2 tokens: (last token - first token) /
                                (tokens - 1), the mean inter-token time the client saw
  e2e_request_latency_seconds   arrival -> the last reply, for requests that finished
  requests_total{finish_reason} every request once: stop | length (the model's), error
                                (the client got an error status), abort (the client left)
  prompt_tokens_total, generation_tokens_total   of finished requests
  migrations_total              moves to another decode node mid-stream
  num_requests_running          requests in the gateway now (waiting for a node included)
  num_requests_waiting_for_node requests waiting for a decode node to route to (none now)
  node_wait_seconds             how long each wait for a node lasted (it found one or gave up)

Thread-safety: event loop only (prometheus_client's metrics are thread-safe anyway).
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from common.metrics import LATENCY_BUCKETS, TPOT_BUCKETS, TTFT_BUCKETS, name

FINISH_REASONS = ("stop", "length", "abort", "error")


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = r = registry if registry is not None else CollectorRegistry()
        self.ttft = Histogram(name("time_to_first_token_seconds"), "Time to first token at the gateway.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram(name("time_per_output_token_seconds"),
                              "Mean time per output token after the first, per request.",
                              buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram(name("e2e_request_latency_seconds"), "Arrival to last token of finished requests.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.requests = Counter(name("requests"), "Client requests by how they ended.", ["finish_reason"],
                                registry=r)
        for reason in FINISH_REASONS:   # every series from the start: rate() sees the first one
            self.requests.labels(finish_reason=reason)
        self.prompt_tokens = Counter(name("prompt_tokens"), "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter(name("generation_tokens"), "Tokens sent to clients.", registry=r)
        self.migrations = Counter(name("migrations"), "Requests moved to another decode node mid-stream.",
                                  registry=r)
        self.running = Gauge(name("num_requests_running"), "Client requests streaming now.", registry=r)
        self.node_waiting = Gauge(name("num_requests_waiting_for_node"),
                                  "Client requests waiting for a decode node to route to.", registry=r)
        self.node_wait = Histogram(name("node_wait_seconds"), "Waits of requests for a decode node to route to.",
                                   buckets=LATENCY_BUCKETS, registry=r)

    def timer(self, arrival: float | None = None) -> "RequestTimer":
        """One request's timer; arrival: its time.perf_counter() at the gateway (default now)."""
        return RequestTimer(self, time.perf_counter() if arrival is None else arrival)


class RequestTimer:
    """Feed every reply to on_reply, then end() once (after a finish it is a no-op)."""

    def __init__(self, metrics: GatewayMetrics, arrival: float):
        self.metrics, self.arrival = metrics, arrival
        self.first_at: float | None = None
        self.last_at: float | None = None      # the latest reply with tokens
        self.num_tokens = 0
        self.ended = False
        metrics.running.inc()

    def on_reply(self, num_tokens: int, finish_reason: str, num_prompt_tokens: int = 0) -> None:
        now = time.perf_counter()
        m = self.metrics
        if num_tokens and self.first_at is None:
            self.first_at = now
            m.ttft.observe(now - self.arrival)
        if num_tokens:
            self.last_at = now
        self.num_tokens += num_tokens
        m.generation_tokens.inc(num_tokens)
        if finish_reason:
            if self.num_tokens > 1:
                m.tpot.observe((now - self.first_at) / (self.num_tokens - 1))
            m.e2e.observe(now - self.arrival)
            m.prompt_tokens.inc(num_prompt_tokens)
            self.end(finish_reason)

    @property
    def ttft_s(self) -> float | None:
        """Arrival -> the first reply with tokens; None before one."""
        return None if self.first_at is None else self.first_at - self.arrival

    @property
    def token_gaps_s(self) -> float:
        """The first reply with tokens -> the latest one (0 before two)."""
        return 0.0 if self.first_at is None else self.last_at - self.first_at

    def end(self, reason: str) -> None:
        """The request ended: `error`, `abort`, or (from on_reply) its finish_reason."""
        if self.ended:
            return
        self.ended = True
        self.metrics.running.dec()
        self.metrics.requests.labels(finish_reason=reason).inc()
