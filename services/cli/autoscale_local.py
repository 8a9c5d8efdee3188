"""The autoscaler's hands on a running `pdmesh up` mesh (services/cli/autoscaler.py):
real processes (MeshProcesses.add_node / remove_node) and real RPCs as the operator
(MetaAdmin GetPlanner / DrainNode / UndrainNode / RemoveNode at the meta-server,
GetEngineStats at the nodes). A stand-in with the same methods drives the autoscaler in
tests/unit/test_autoscale.py."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import grpc

from services.cli.autoscale_plan import POOL_OF, busy
from services.cli.autoscaler import RPC_TIMEOUT_S, STOP_GRACE_S, PlannerView


class LocalMesh:
    """The autoscaler's hands on a running MeshProcesses (real processes, real RPCs as the
    operator). Methods block for at most one RPC, except start()'s returned wait and stop()."""

    def __init__(self, mesh):
        self.mesh = mesh
        self._meta = self._meta_channel = None
        self._nodes: dict[str, object] = {}    # address -> channel

    def config_nodes(self) -> list[tuple[str, str]]:
        """(node_id, role) of the config's engine nodes, in its order."""
        return [(n.node_id, n.role) for n in self.mesh.mesh.nodes]

    def taken(self, node_id: str) -> bool:
        return node_id in self.mesh.services or any(n.node_id == node_id for n in self.mesh.mesh.nodes)

    def _admin(self):
        if self._meta is None:
            from protos.pdmesh.v1 import meta_pb2_grpc
            self._meta_channel = self.mesh.admin_channel()
            self._meta = meta_pb2_grpc.MetaAdminStub(self._meta_channel)
        return self._meta

    def read_planner(self) -> PlannerView:
        """The planner's last decision (num_decisions 0: none yet). grpc.RpcError when the
        meta-server does not answer; ValueError when its planner is off."""
        from protos.pdmesh.v1 import meta_pb2
        reply = self._admin().GetPlanner(meta_pb2.GetPlannerRequest(), timeout=RPC_TIMEOUT_S)
        if not reply.enabled:
            raise ValueError("the meta-server's planner is off (meta_server.planner.enabled)")
        return PlannerView(reply.num_decisions, {r.role: r.desired_nodes for r in reply.roles},
                           {r.role: r.reason for r in reply.roles})

    def drain(self, node_id: str) -> None:
        from protos.pdmesh.v1 import meta_pb2
        self._admin().DrainNode(meta_pb2.DrainNodeRequest(node_id=node_id), timeout=RPC_TIMEOUT_S)

    def undrain(self, node_id: str) -> None:
        from protos.pdmesh.v1 import meta_pb2
        self._admin().UndrainNode(meta_pb2.UndrainNodeRequest(node_id=node_id), timeout=RPC_TIMEOUT_S)

    def forget(self, node_id: str) -> None:
        """RemoveNode at the meta-server (its drained flag, counts, prefix index); a node it
        no longer knows is fine."""
        from protos.pdmesh.v1 import meta_pb2
        try:
            self._admin().RemoveNode(meta_pb2.RemoveNodeRequest(node_id=node_id), timeout=RPC_TIMEOUT_S)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.NOT_FOUND:
                raise

    def work(self, node_id: str) -> dict[str, int] | None:
        """busy() of the node's GetEngineStats; None when it does not answer."""
        from protos.pdmesh.v1 import engine_pb2, engine_pb2_grpc
        svc = self.mesh.services.get(node_id)
        if svc is None:
            return None
        if svc.address not in self._nodes:
            self._nodes[svc.address] = self.mesh.operator_channel(svc.address)
        channel = self._nodes[svc.address]
        stub = engine_pb2_grpc.PrefillStub(channel) if svc.role == "prefill" else engine_pb2_grpc.DecodeStub(channel)
        try:
            return busy(stub.GetEngineStats(engine_pb2.EngineStatsRequest(), timeout=RPC_TIMEOUT_S))
        except grpc.RpcError:
            return None

    def exit_code(self, node_id: str) -> int | None:
        """Its process's exit code, None while it runs."""
        svc = self.mesh.services.get(node_id)
        return None if svc is None or svc.process is None else svc.process.poll()

    def template(self, role: str) -> dict:
        """The `nodes:` entry a new node of role starts from: the config's first node of that
        role (for decode, else its first `both` node), with its host, advertise_host (every
        node of `pdmesh up` runs on this host), max_queue and engine fields but no pinned
        cores; a metrics port of its own when the template serves metrics."""
        import yaml
        raw = yaml.safe_load(Path(self.mesh.config_path).read_text()).get("nodes") or []
        first = [e for e in raw if e.get("role") == role] or [e for e in raw if POOL_OF.get(e.get("role")) == role]
        tpl = first[0] if first else {}
        entry = {k: v for k, v in tpl.items() if k in ("host", "advertise_host", "max_queue")}
        engine = {k: v for k, v in (tpl.get("engine") or {}).items() if k not in ("cpu_cores", "borrow_cores")}
        if engine:
            entry["engine"] = engine
        if tpl.get("metrics_port"):
            entry["metrics_port"] = self.mesh._new_port(tpl.get("host", "127.0.0.1"))   # noqa: SLF001 (planned for this mesh)
        return entry

    def start(self, node_id: str, role: str) -> Callable[[], None]:
        """Spawn the node (add_node); returns the call that waits until it is healthy and
        registered (RuntimeError naming its log when it is not)."""
        return self.mesh.add_node({**self.template(role), "role": role, "node_id": node_id, "port": 0}, wait=False)

    def stop(self, node_id: str) -> None:
        """SIGTERM, wait (SIGKILL past STOP_GRACE_S) and forget the node (remove_node)."""
        svc = self.mesh.services.get(node_id)
        if svc is not None:
            self.mesh.remove_node(node_id, grace_s=STOP_GRACE_S)
            channel = self._nodes.pop(svc.address, None)
            if channel is not None:
                channel.close()

    def close(self) -> None:
        for channel in [*self._nodes.values(), *filter(None, [self._meta_channel])]:
            channel.close()
        self._nodes.clear()
        self._meta = self._meta_channel = None
