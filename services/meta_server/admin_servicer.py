"""MetaAdmin gRPC servicer: the operator API. Thin: proto <-> MetaControl at the edge.
Unknown node id -> NOT_FOUND; unknown policy -> INVALID_ARGUMENT naming the allowed ones;
admin store unreachable -> UNAVAILABLE (nothing changed)."""
from __future__ import annotations

import grpc

from protos.pdmesh.v1 import meta_pb2, meta_pb2_grpc
from services.meta_server.admin_state import AdminStateUnavailableError
from services.meta_server.control import MetaControl, NodeStatus, UnknownNodeError


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
