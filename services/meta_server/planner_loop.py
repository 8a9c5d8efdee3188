"""The planner at work in the meta-server: every interval_s it reads the interval's load
(planner_inputs.py: the gateways' reports, Route's prefix hits, the nodes' heartbeats),
runs Planner.decide (planner.py) and keeps the result for the metrics
(pdmesh:planner_desired_nodes{role} and the inputs, metrics.py) and the admin API
(MetaAdmin/GetPlanner, `pdmesh admin planner`).

    loop = PlannerLoop(cfg, profile, control)   # control.planner = loop
    loop.report(totals)                          # ReportRequests (the leader only)
    loop.start()                                 # tick() every cfg.interval_s
    loop.last                                    # the last PlannedInterval, None before the first
    await loop.close()

Only the leader plans: a standby (or a new leader still reloading its admin state) drops
what it got in the interval and decides nothing, so its metrics keep the last decision it
made as leader, if any. A tick that fails is logged and the next one runs.

Thread-safety: the meta-server's event loop only.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from common.planner_config import PlannerConfig
from common.tasks import cancel_task
from services.meta_server.load_window import LoadWindow, RequestTotals
from services.meta_server.planner import ROLES, NodeProfile, Planner, PlannerDecision
from services.meta_server.planner_inputs import PlannerInputs, RoutedTokens, gather

log = logging.getLogger("pdmesh.meta")


@dataclass(frozen=True)
class PlannedInterval:
    number: int                        # 1 for the first decision
    at: float                          # the clock's time of the decision
    inputs: PlannerInputs
    decision: PlannerDecision


class PlannerLoop:
    def __init__(self, cfg: PlannerConfig, profile: NodeProfile, control, clock=time.monotonic):
        """control: the MetaControl whose router, registry and admin state it reads."""
        self.cfg, self.profile, self.control, self.clock = cfg, profile, control, clock
        self.planner = Planner(cfg, profile)
        self.window = LoadWindow()
        self.last: PlannedInterval | None = None
        self.num_decisions = 0
        self._routed_mark = self._routed()
        self._task: asyncio.Task | None = None

    def _routed(self) -> RoutedTokens:
        r = self.control.router
        return RoutedTokens(r.num_routed, r.num_prompt_tokens_routed, r.num_hit_tokens_routed)

    def leading(self) -> bool:
        return self.control.standby_reason() is None

    def report(self, totals: RequestTotals) -> None:
        """One gateway report, counted in the current interval."""
        self.window.add(totals)

    def tick(self) -> PlannedInterval | None:
        """End the interval: gather its inputs, decide, keep and return the result (None on
        a standby, which drops the interval)."""
        totals = self.window.take()
        now_routed, before = self._routed(), self._routed_mark
        self._routed_mark = now_routed
        if not self.leading():
            return None
        routed = RoutedTokens(*(a - b for a, b in zip(
            (now_routed.num_routes, now_routed.prompt_tokens, now_routed.hit_tokens),
            (before.num_routes, before.prompt_tokens, before.hit_tokens))))
        c = self.control
        inputs = gather(totals, routed, c.live_members(), c.admin.drained_node_ids(), self.cfg.interval_s)
        now = self.clock()
        decision = self.planner.decide(inputs.sample, now)
        self.num_decisions += 1
        self.last = PlannedInterval(self.num_decisions, now, inputs, decision)
        current = {"prefill": inputs.sample.prefill_nodes, "decode": inputs.sample.decode_nodes}
        for role in ROLES:
            if decision.nodes[role] != current[role]:
                log.info("planner: %s nodes %d -> %d: %s", role, current[role], decision.nodes[role],
                         decision.reasons[role])
        return self.last

    def start(self) -> None:
        """tick() every cfg.interval_s on the running event loop, until close()."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.interval_s)
            try:
                self.tick()
            except Exception:   # a bug in one interval must not end planning
                log.exception("planner: the interval's decision failed; the next one runs in %gs",
                              self.cfg.interval_s)

    async def close(self) -> None:
        await cancel_task(self._task)
        self._task = None
