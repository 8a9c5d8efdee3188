"""MetaAdmin gRPC servicer: the operator API. Thin: proto <-> MetaControl at the edge.
Unknown node id -> NOT_FOUND; unknown policy -> INVALID_ARGUMENT naming the allowed ones;
admin store unreachable -> UNAVAILABLE (nothing changed)."""
from __future__ import annotations

import grpc

from protos.pdmesh.v1 import meta_pb2, meta_pb2_grpc
from services.meta_server.admin_state import AdminStateUnavailableError
from services.meta_server.control import MetaControl, NodeStatus, UnknownNodeError
from services.meta_server.planner import ROLES
from services.meta_server.planner_loop import PlannerLoop


def planner_proto(loop: PlannerLoop | None) -> meta_pb2.GetPlannerResponse:
    """The planner's settings and last decision (GetPlanner); enabled = False when off."""
    if loop is None:
        return meta_pb2.GetPlannerResponse(enabled=False)
    cfg = loop.cfg
    reply = meta_pb2.GetPlannerResponse(
        enabled=True, interval_s=cfg.interval_s, ttft_slo_ms=cfg.ttft_slo_ms, itl_slo_ms=cfg.itl_slo_ms,
        min_nodes=cfg.min_nodes, max_nodes=cfg.max_nodes, profile=cfg.profile, num_decisions=loop.num_decisions)
    last = loop.last
    if last is None:
        return reply
    s, d = last.inputs.sample, last.decision
    reply.seconds_since_decision = max(loop.clock() - last.at, 0.0)
    reply.inputs.CopyFrom(meta_pb2.PlannerInputs(
        interval_s=last.inputs.interval_s, num_requests=s.requests, request_rate=last.inputs.request_rate,
        mean_prompt_tokens=s.mean_prompt_tokens, mean_output_tokens=s.mean_output_tokens,
        prefix_hit_rate=s.prefix_hit_rate, prefill_queue_tokens=s.prefill_queue_tokens,
        decode_kv_usage=last.inputs.decode_kv_usage, observed_ttft_s=s.observed_ttft_s or 0.0,
        observed_itl_s=s.observed_itl_s or 0.0, prefill_nodes=s.prefill_nodes, decode_nodes=s.decode_nodes))
    current = {"prefill": s.prefill_nodes, "decode": s.decode_nodes}
    reply.roles.extend(meta_pb2.PlannerRole(role=role, current_nodes=current[role], wanted_nodes=d.wanted[role],
                                            desired_nodes=d.nodes[role], reason=d.reasons[role]) for role in ROLES)
    return reply


def node_status_proto(status: NodeStatus) -> meta_pb2.NodeStatus:
    return meta_pb2.NodeStatus(info=status.info, state=status.state,
                               seconds_since_heartbeat=status.seconds_since_heartbeat,
                               num_routed=status.num_routed)


async def _checked(context, awaitable):
    """Await a MetaControl call; its errors become status codes."""
    try:
        return await awaitable
    except UnknownNodeError as e:
        await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
    except ValueError as e:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    except AdminStateUnavailableError as e:
        await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))


class MetaAdminServicer(meta_pb2_grpc.MetaAdminServicer):
    """Reads are served by any meta-server; changes only by the leader (a standby's
    cached admin state is refreshed when it takes over)."""

    def __init__(self, control: MetaControl):
        self.control = control

    async def _leader_only(self, context) -> None:
        reason = self.control.standby_reason()
        if reason:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{reason}; send changes to the leader")

    async def ListNodes(self, request, context):
        return meta_pb2.ListNodesResponse(nodes=[node_status_proto(s) for s in self.control.list_nodes()])

    async def DrainNode(self, request, context):
        await self._leader_only(context)
        status = await _checked(context, self.control.drain(request.node_id))
        return meta_pb2.DrainNodeResponse(node=node_status_proto(status))

    async def UndrainNode(self, request, context):
        await self._leader_only(context)
        status = await _checked(context, self.control.undrain(request.node_id))
        reply = meta_pb2.UndrainNodeResponse()
        if status is not None:
            reply.node.CopyFrom(node_status_proto(status))
        return reply

    async def RemoveNode(self, request, context):
        await self._leader_only(context)
        await _checked(context, self.control.remove(request.node_id))
        return meta_pb2.RemoveNodeResponse()

    def _policy_reply(self) -> meta_pb2.PolicyResponse:
        return meta_pb2.PolicyResponse(policy=self.control.policy(),
                                       allowed=self.control.allowed_policies())

    async def GetPolicy(self, request, context):
        return self._policy_reply()

    async def SetPolicy(self, request, context):
        await self._leader_only(context)
        await _checked(context, self.control.set_policy(request.policy))
        return self._policy_reply()

    async def GetStats(self, request, context):
        s = self.control.stats()
        return meta_pb2.GetStatsResponse(
            policy=s.policy, num_routed=s.num_routed, num_local_prefill=s.num_local_prefill,
            nodes=[meta_pb2.NodeRouteCount(node_id=n, role=r, num_routed=c) for n, r, c in s.routed_by_node],
            free_blocks=s.free_blocks, total_blocks=s.total_blocks)

    async def GetPlanner(self, request, context):
        return planner_proto(self.control.planner)
