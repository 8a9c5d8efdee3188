"""`pdmesh up --autoscale prefill=1:3,decode=1:3`: start and drain local engine nodes to
follow the meta-server's planner (docs/planner.md; the decisions are autoscale_plan.py's).

    scaler = Autoscaler(LocalMesh(mesh), bounds, interval_s)   # autoscale_local.py; mesh: started
    while supervising:
        scaler.step()                  # non-blocking: slow work runs on threads of its own
        if scaler.owns(name): ...      # the supervisor leaves that node alone
    scaler.close()                     # before mesh.stop(), which stops the nodes it started

Each step: the planner's decision is read (MetaAdmin/GetPlanner, admin token) every
READ_EVERY of its interval; a new decision (or, at the first step, the bounds alone) is
turned into actions per role: start (MeshProcesses.add_node with an id `ROLE-aN`, the
role's first config entry as the template: its host and engine fields, a new port),
drain (DrainNode) or undrain (UndrainNode). Draining nodes are polled every DRAIN_POLL_S
(GetEngineStats) and stopped (MeshProcesses.remove_node: SIGTERM, it deregisters; then
RemoveNode forgets its drained flag) once idle. One status line per action, in the form
of `pdmesh up`'s lines: `NODE  ROLE  what`.

Thread-safety: step(), owns() and close() from one thread (the supervisor's); starts and
stops run on daemon threads that touch only their own node.
"""
from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass
from typing import Callable

import grpc

from services.cli.autoscale_plan import (DRAIN_REPORT_S, POOL_OF, ROLES, Action, Bounds, NodeState, PoolNode,
                                         describe_work, may_stop, plan_role)

READ_EVERY = 0.25       # of the planner's interval: a decision is acted on within this share of one
DRAIN_POLL_S = 0.5
RPC_TIMEOUT_S = 2.0
STOP_GRACE_S = 30.0     # an idle node that has not exited this long after SIGTERM is killed


@dataclass(frozen=True)
class PlannerView:
    num_decisions: int
    desired: dict[str, int]             # per role, the count to run
    reasons: dict[str, str]


class _Job:
    """A start or a stop on a daemon thread; error: what it raised."""

    def __init__(self, kind: str, fn: Callable[[], None]):
        self.kind, self.error = kind, None
        self.thread = threading.Thread(target=self._run, args=(fn,), daemon=True, name=f"autoscale-{kind}")
        self.thread.start()

    def _run(self, fn) -> None:
        try:
            fn()
        except BaseException as e:   # reported by step()
            self.error = e

    @property
    def done(self) -> bool:
        return not self.thread.is_alive()


class Autoscaler:
    """Keeps each bounded role's pool at the planner's count (module docstring); the pool
    starts as the config's nodes of the role."""

    def __init__(self, hands, bounds: dict[str, Bounds], interval_s: float, say: Callable[[str], None] = print,
                 clock: Callable[[], float] = time.monotonic, drain_report_s: float = DRAIN_REPORT_S):
        """hands: a LocalMesh (autoscale_local.py, or anything with its methods); bounds:
        parse_autoscale's."""
        self.hands, self.bounds, self.say, self.clock = hands, bounds, say, clock
        self.read_every_s = max(interval_s * READ_EVERY, 0.2)
        self.drain_report_s = drain_report_s
        self.nodes: dict[str, PoolNode] = {}
        for seq, (node_id, role) in enumerate(hands.config_nodes()):
            if POOL_OF[role] in bounds:
                self.nodes[node_id] = PoolNode(node_id, POOL_OF[role], from_config=True, seq=seq)
        self._seq = itertools.count(len(hands.config_nodes()))
        self._numbers = {role: itertools.count(1) for role in ROLES}
        self._jobs: dict[str, _Job] = {}
        self._decisions = -1            # the last decision acted on (-1: none yet, not even the bounds)
        self._next_read = self._next_poll = 0.0
        self._read_error = ""           # said once while the planner cannot be read
        self._held: dict[str, int | None] = {}   # role -> the planner's out-of-bounds count last said
        self.closing = False

    # ---- what the supervisor asks ------------------------------------------------------
    def owns(self, name: str) -> bool:
        """True while the node is starting, draining or stopping: the supervisor neither
        restarts nor health-reports it."""
        node = self.nodes.get(name)
        return node is not None and node.state != NodeState.SERVING

    def _say(self, node_id: str, role: str, what: str) -> None:
        self.say(f"{node_id:<12} {role:<11} {what}")

    # ---- one step ------------------------------------------------------------------------
    def step(self) -> None:
        now = self.clock()
        self._finish_jobs()
        if self._decisions < 0:         # the first step: the bounds alone
            self._apply(None)
            self._decisions = 0
        if now >= self._next_read:
            self._next_read = now + self.read_every_s
            view = self._read()
            if view is not None and view.num_decisions > self._decisions:
                self._decisions = view.num_decisions
                self._apply(view)
        if now >= self._next_poll:
            self._next_poll = now + DRAIN_POLL_S
            self._poll_drains(now)

    def _read(self) -> PlannerView | None:
        try:
            view = self.hands.read_planner()
        except (grpc.RpcError, ValueError) as e:
            why = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.RpcError) else str(e)
            if why != self._read_error:
                self._say("autoscale", "", f"cannot read the planner ({why}); trying again")
                self._read_error = why
            return None
        if self._read_error:
            self._say("autoscale", "", "reading the planner again")
            self._read_error = ""
        return view

    def _new_ids(self, role: str):
        while True:
            node_id = f"{role}-a{next(self._numbers[role])}"
            if node_id not in self.nodes and not self.hands.taken(node_id):
                yield node_id

    def _apply(self, view: PlannerView | None) -> None:
        for role in ROLES:
            if role not in self.bounds:
                continue
            bounds = self.bounds[role]
            desired = None if view is None else view.desired.get(role)
            held = desired is not None and bounds.clamp(desired) != desired
            if held and self._held.get(role) != desired:
                self._say("autoscale", role, f"the planner wants {desired} nodes; held within {bounds}")
            self._held[role] = desired if held else None
            counted = sum(1 for n in self.nodes.values() if n.role == role and n.counted)
            actions = plan_role(role, desired, bounds, list(self.nodes.values()), self._new_ids(role))
            if actions:
                why = ("below the lower bound" if view is None else
                       f"planner decision {view.num_decisions}: {view.reasons.get(role, '')}")
                target = counted + sum(1 if a.kind != "drain" else -1 for a in actions)
                self._say("autoscale", role, f"{counted} -> {target} nodes ({why})")
            for action in actions:
                self._act(action)

    def _act(self, a: Action) -> None:
        if a.kind == "start":
            try:
                wait = self.hands.start(a.node_id, a.role)
            except (OSError, ValueError, RuntimeError) as e:
                self._say(a.node_id, a.role, f"could not start: {e}")
                return
            self.nodes[a.node_id] = PoolNode(a.node_id, a.role, from_config=False, seq=next(self._seq),
                                             state=NodeState.STARTING)
            self._jobs[a.node_id] = _Job("start", wait)
            self._say(a.node_id, a.role, "starting (autoscale)")
            return
        node = self.nodes[a.node_id]
        try:
            (self.hands.drain if a.kind == "drain" else self.hands.undrain)(a.node_id)
        except grpc.RpcError as e:
            self._say(a.node_id, a.role, f"could not {a.kind}: {e.code().name}: {e.details()}")
            return
        if a.kind == "drain":
            node.state, node.drained_at, node.idle_since, node.reported = (NodeState.DRAINING, self.clock(),
                                                                           None, False)
            self._say(a.node_id, a.role, "draining (autoscale): stops once nothing runs, waits or moves KV")
        else:
            node.state = NodeState.SERVING
            self._say(a.node_id, a.role, "undrained (autoscale): wanted again before it stopped")

    def _poll_drains(self, now: float) -> None:
        for node in [n for n in self.nodes.values() if n.state == NodeState.DRAINING]:
            code = self.hands.exit_code(node.node_id)
            if code is not None:    # it exited by itself while draining: it was leaving anyway
                self._say(node.node_id, node.role, f"exited with code {code} while draining; not restarted")
                node.state = NodeState.STOPPING
                self._jobs[node.node_id] = _Job("stop", self._stopper(node.node_id))
                continue
            work = self.hands.work(node.node_id)
            if may_stop(node, work, now):
                node.state = NodeState.STOPPING
                self._say(node.node_id, node.role, f"drained in {now - node.drained_at:.1f}s; stopping")
                self._jobs[node.node_id] = _Job("stop", self._stopper(node.node_id))
            elif now - node.drained_at >= self.drain_report_s and not node.reported:
                node.reported = True
                self._say(node.node_id, node.role, f"still draining after {now - node.drained_at:.0f}s "
                          f"({describe_work(work)}); not stopped while it has work")

    def _stopper(self, node_id: str) -> Callable[[], None]:
        def stop() -> None:
            self.hands.stop(node_id)
            self.hands.forget(node_id)
        return stop

    def _finish_jobs(self) -> None:
        for node_id, job in [(k, j) for k, j in self._jobs.items() if j.done]:
            del self._jobs[node_id]
            node = self.nodes[node_id]
            if job.kind == "start" and job.error is None:
                node.state = NodeState.SERVING
                continue
            if job.kind == "start":
                if not self.closing:
                    self._say(node_id, node.role, f"did not start: {job.error}")
                try:
                    self.hands.stop(node_id)   # forget the dead process
                except Exception:   # noqa: BLE001 (it is gone either way)
                    pass
            elif job.error is not None and not self.closing:
                self._say(node_id, node.role, f"stopped, but the meta-server did not forget it: {job.error}")
            del self.nodes[node_id]

    def settle(self, timeout_s: float = STOP_GRACE_S + 5, kinds: tuple[str, ...] = ("start", "stop")) -> None:
        """Wait (up to timeout_s in all) for the starts and stops under way to end; the next
        step() takes their results."""
        deadline = time.monotonic() + timeout_s
        for job in list(self._jobs.values()):
            if job.kind in kinds:
                job.thread.join(max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        """Wait for the stops under way (a node half stopped would be stopped again by
        mesh.stop); starts are left to mesh.stop, which ends them."""
        self.closing = True
        self.settle(kinds=("stop",))
        self.hands.close()
