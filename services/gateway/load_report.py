"""The gateway's reports to the meta-server's planner: sums over the client requests that
ended (pdmesh.v1.MetaServer/ReportRequests), sent every few seconds on a task of their own.

    reporter = LoadReporter(meta_client, every_s=report_every_s(planner.interval_s),
                            timeout_s=timeouts.load_report_s)
    reporter.add(prompt_tokens, output_tokens, ttft_s, token_gaps_s)   # a request ended
    await reporter.flush()                                            # send now (tests)
    await reporter.close()

Never on a request's path: add() only adds to a few numbers (constant memory however many
requests end) and starts the sending task on its first call; the task sends what was
added since the last report, nothing when nothing was. A report that fails (the
meta-server down, slow past timeout_s, or a standby with no leader found) is dropped,
not sent again: the next report covers only its own seconds, so the planner never sees
an outage's requests land in one interval. A failing meta-server is logged once per
outage.

Thread-safety: the gateway's event loop only.
"""
from __future__ import annotations

import asyncio
import logging
import time

import grpc

from common.tasks import cancel_task
from protos.pdmesh.v1 import meta_pb2

log = logging.getLogger("pdmesh.gateway")
# a few reports per planner interval, so that an interval's requests reach it in that
# interval; one small unary call every 2 s costs the meta-server nothing it would notice
REPORT_EVERY_S = 2.0


def report_every_s(interval_s: float) -> float:
    """How often to report for a planner deciding every interval_s: REPORT_EVERY_S, or a
    quarter of a shorter interval."""
    return min(REPORT_EVERY_S, interval_s / 4)


class LoadReporter:
    def __init__(self, meta, every_s: float, timeout_s: float):
        """meta: a MetaClient (services/gateway/meta_client.py); every_s > 0."""
        if not every_s > 0:
            raise ValueError(f"every_s must be > 0, got {every_s}")
        self.meta, self.every_s, self.timeout_s = meta, every_s, timeout_s
        self._sums = meta_pb2.ReportRequestsRequest()
        self._task: asyncio.Task | None = None
        self._failing = False
        self.num_sent = self.num_dropped = 0       # reports

    def add(self, prompt_tokens: int, output_tokens: int, ttft_s: float | None, token_gaps_s: float) -> None:
        """One request ended: its prompt and output tokens, its time to first token (None:
        it got none) and the time from its first token to its last."""
        s = self._sums
        s.num_requests += 1
        s.prompt_tokens += prompt_tokens
        s.output_tokens += output_tokens
        if ttft_s is not None:
            s.num_first_tokens += 1
            s.ttft_s_sum += max(ttft_s, 0.0)
        if output_tokens >= 2:
            s.num_token_gaps += output_tokens - 1
            s.token_gaps_s_sum += max(token_gaps_s, 0.0)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def flush(self) -> bool:
        """Send what was added since the last report, now; True when the meta-server took
        it, False when there was nothing to send or the report was dropped."""
        sums, self._sums = self._sums, meta_pb2.ReportRequestsRequest()
        if not sums.num_requests:
            return False
        try:
            reply = await self.meta.call("ReportRequests", sums, timeout=self.timeout_s,
                                         deadline=time.monotonic() + self.timeout_s)
        except grpc.aio.AioRpcError as e:
            self.num_dropped += 1
            if not self._failing:
                log.warning("planner report of %d requests dropped: meta-server %s said %s %s (logged once "
                            "until a report goes through)", sums.num_requests, self.meta.current_address,
                            e.code().name, e.details())
            self._failing = True
            return False
        if self._failing:
            log.info("planner reports reach the meta-server again (%d dropped so far)", self.num_dropped)
        self._failing = False
        self.num_sent += 1
        if not reply.accepted:
            log.debug("the meta-server's planner is off: report dropped there")
        return reply.accepted

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            try:
                await self.flush()
            except Exception:   # a bug in one report must not end reporting
                log.exception("planner report failed")

    async def close(self) -> None:
        """Stop the task (what was added since the last report is not sent)."""
        await cancel_task(self._task)
        self._task = None
