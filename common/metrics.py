"""Prometheus metrics: what every service shares. Each service builds its own
CollectorRegistry (never prometheus_client's global one, so that services started in one
process, as tests do, never collide) and serves it with MetricsServer on its
`metrics_port` (0 = off). The service-specific metrics live next to their service:
services/gateway/metrics.py, services/node/metrics.py, services/meta_server/metrics.py,
services/kv_store/metrics.py.

Names follow vLLM's with a `pdmesh:` prefix (`vllm:time_to_first_token_seconds` ->
`pdmesh:time_to_first_token_seconds`); engine metrics carry the label `node`.

MetricsServer answers `GET /metrics` (the text exposition format) on the service's event
loop. The gateway's, meta-server's and kv-store's counters change on that loop too; an
engine node's gauges read the engine's counts while its step thread may change them
(LLMEngine.stats: single atomic reads, used + free from one), so a scrape may be a step
old and no collector takes a lock. Anything else is 404 (405 for another method).
"""
from __future__ import annotations

import asyncio
import logging

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from common.bind_error import BindError

log = logging.getLogger("pdmesh.metrics")
PREFIX = "pdmesh:"
# vLLM's buckets (vllm/v1/metrics/loggers.py), in seconds
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                   120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
READ_LIMIT = 8192          # bytes of request head accepted
READ_TIMEOUT_S = 5.0


def name(metric: str) -> str:
    """`time_to_first_token_seconds` -> `pdmesh:time_to_first_token_seconds`."""
    return PREFIX + metric


SERIES_SUFFIXES = {"counter": ("_total", "_created"), "gauge": ("",),
                   "histogram": ("_bucket", "_count", "_sum", "_created"), "summary": ("", "_count", "_sum", "_created")}


def exported_names(registry: CollectorRegistry) -> set[str]:
    """Every series name registry exports, also of families without samples yet (a
    labelled counter nobody has counted in): `_total` of counters, `_bucket`, `_count`,
    `_sum` of histograms, `_created` of both."""
    names = set()
    for family in registry.collect():
        names.update(family.name + s for s in SERIES_SUFFIXES.get(family.type, ("",)))
        names.update(s.name for s in family.samples)
    return names


class MetricsServer:
    """GET /metrics of one registry over HTTP/1.0-style connections (one answer, then
    close). start() binds and returns the port; close() stops listening."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry
        self._server: asyncio.AbstractServer | None = None

    async def start(self, host: str, port: int) -> int:
        """BindError when host:port cannot be bound."""
        try:
            self._server = await asyncio.start_server(self._handle, host, port, limit=READ_LIMIT)
        except OSError as e:
            raise BindError(f"cannot bind the metrics port {host}:{port} ({e.strerror})") from None
        return self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT_S)
            method, path, *_ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
            if method not in ("GET", "HEAD"):
                status, ctype, body = "405 Method Not Allowed", "text/plain", b"only GET\n"
            elif path.split("?", 1)[0] != "/metrics":
                status, ctype, body = "404 Not Found", "text/plain", b"see /metrics\n"
            else:
                status, ctype, body = "200 OK", CONTENT_TYPE_LATEST, generate_latest(self.registry)
            writer.write((f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                          "Connection: close\r\n\r\n").encode("latin-1"))
            if method != "HEAD":
                writer.write(body)
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError,
                ValueError, ConnectionError):
            pass   # a malformed or vanished client: nothing to answer
        except Exception:
            log.exception("metrics scrape failed")
        finally:
            writer.close()


async def serve_metrics(registry: CollectorRegistry, host: str, port: int,
                        what: str) -> MetricsServer | None:
    """Serve registry on host:port; None when port is 0 (metrics off)."""
    if not port:
        return None
    server = MetricsServer(registry)
    bound = await server.start(host, port)
    log.info("%s metrics at http://%s:%d/metrics", what, host, bound)
    return server


async def close_metrics(server) -> None:
    """Stop the MetricsServer a service keeps as `server.metrics_server` (if any)."""
    metrics = getattr(server, "metrics_server", None)
    if metrics is not None:
        await metrics.close()
