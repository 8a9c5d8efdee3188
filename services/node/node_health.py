"""What an engine node says about itself: grpc.health and its membership follow its
engine, every POLL_S.

  engine dead (the step loop raised, or one of its tensor-parallel ranks exited, also
      while the engine is idle)      -> NOT_SERVING at once, leave the mesh (deregister
      / revoke the lease: routed to no more), `failed` is set; the requests in flight have
      already failed UNAVAILABLE (the gateway migrates them). The process then exits
      non-zero (services/cli/serve.py) so that its supervisor restarts it: `pdmesh up`,
      compose `restart:`, Kubernetes.
  stalled (AsyncEngine.stalled_for_s() > timeouts.stall_s: the step thread has held
      the engine that long, a hung kernel or a deadlock, or a command has waited that
      long in the inbox) -> NOT_SERVING and a report with load.stalled at once: the
      router sends it nothing and the gateway moves its silent streams away; SERVING and
      a report again once it makes progress.

Lifecycle: start() (a task of the running loop) -> close().
"""
from __future__ import annotations

import asyncio
import logging

from grpc_health.v1 import health_pb2

log = logging.getLogger("pdmesh.node")
POLL_S = 0.1   # so NOT_SERVING is reported well within a second of the engine dying


class NodeHealth:
    def __init__(self, node, health_servicer, service_names: list[str]):
        """node: an EngineNode (engine, registration, mesh.timeouts.stall_s)."""
        self.node, self.health, self.names = node, health_servicer, ["", *service_names]
        self.stall_s = node.mesh.timeouts.stall_s
        self.stalled = False
        self.failed = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._watch(), name="node health")

    async def _watch(self) -> None:
        engine = self.node.engine
        while True:
            await asyncio.sleep(POLL_S)
            tp = getattr(self.node.llm_engine, "tp", None)
            rank_failure = tp.failure() if tp is not None else None
            if engine.error is not None or rank_failure is not None:
                await self._engine_died(engine.error or RuntimeError(rank_failure))
                return
            stalled = engine.stalled_for_s() > self.stall_s
            if stalled != self.stalled:
                self.stalled = stalled
                self.node.stalled = stalled
                if stalled:
                    log.error("%s: the engine has made no progress for %gs; NOT_SERVING until it does",
                              self.node.node.node_id, self.stall_s)
                else:
                    log.warning("%s: the engine makes progress again; SERVING", self.node.node.node_id)
                await self._set(health_pb2.HealthCheckResponse.NOT_SERVING if stalled
                                else health_pb2.HealthCheckResponse.SERVING)
                if self.node.registration is not None:
                    self.node.registration.report_now()

    async def _engine_died(self, error: BaseException) -> None:
        log.error("%s: the engine's step loop died (%s); NOT_SERVING, leaving the mesh",
                  self.node.node.node_id, error)
        try:
            await self._set(health_pb2.HealthCheckResponse.NOT_SERVING)
            if self.node.registration is not None:
                # bounded: with etcd away the lease cannot be revoked; it lapses in a TTL
                await asyncio.wait_for(self.node.registration.close(), self.node.mesh.meta.ttl_seconds)
        except Exception:
            log.exception("%s: leaving the mesh failed; its membership lapses in a TTL", self.node.node.node_id)
        finally:
            self.failed.set()

    async def _set(self, status) -> None:
        for name in self.names:
            await self.health.set(name, status)

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
