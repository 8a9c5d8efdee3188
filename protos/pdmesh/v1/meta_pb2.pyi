from protos.pdmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RegisterRequest(_message.Message):
    __slots__ = ("node", "ttl_seconds", "instance_id")
    NODE_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    node: _common_pb2.NodeInfo
    ttl_seconds: float
    instance_id: str
    def __init__(self, node: _Optional[_Union[_common_pb2.NodeInfo, _Mapping]] = ..., ttl_seconds: _Optional[float] = ..., instance_id: _Optional[str] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("ttl_seconds",)
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ttl_seconds: float
    def __init__(self, ttl_seconds: _Optional[float] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("node_id", "load", "instance_id", "expert_tokens")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    EXPERT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    load: _common_pb2.NodeLoad
    instance_id: str
    expert_tokens: _common_pb2.ExpertTokens
    def __init__(self, node_id: _Optional[str] = ..., load: _Optional[_Union[_common_pb2.NodeLoad, _Mapping]] = ..., instance_id: _Optional[str] = ..., expert_tokens: _Optional[_Union[_common_pb2.ExpertTokens, _Mapping]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DeregisterRequest(_message.Message):
    __slots__ = ("node_id", "instance_id")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    instance_id: str
    def __init__(self, node_id: _Optional[str] = ..., instance_id: _Optional[str] = ...) -> None: ...

class DeregisterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RouteRequest(_message.Message):
    __slots__ = ("request_id", "model_id", "num_prompt_tokens", "block_hashes", "exclude_node_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model_id: str
    num_prompt_tokens: int
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    exclude_node_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_id: _Optional[str] = ..., model_id: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., exclude_node_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class RouteResponse(_message.Message):
    __slots__ = ("decode", "prefill", "local_prefill", "prefill_fallbacks")
    DECODE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    decode: _common_pb2.NodeInfo
    prefill: _common_pb2.NodeInfo
    local_prefill: bool
    prefill_fallbacks: _containers.RepeatedCompositeFieldContainer[_common_pb2.NodeInfo]
    def __init__(self, decode: _Optional[_Union[_common_pb2.NodeInfo, _Mapping]] = ..., prefill: _Optional[_Union[_common_pb2.NodeInfo, _Mapping]] = ..., local_prefill: _Optional[bool] = ..., prefill_fallbacks: _Optional[_Iterable[_Union[_common_pb2.NodeInfo, _Mapping]]] = ...) -> None: ...

class ListMembersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListMembersResponse(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[_common_pb2.NodeInfo]
    def __init__(self, nodes: _Optional[_Iterable[_Union[_common_pb2.NodeInfo, _Mapping]]] = ...) -> None: ...

class ReportRequestsRequest(_message.Message):
    __slots__ = ("num_requests", "prompt_tokens", "output_tokens", "num_first_tokens", "ttft_s_sum", "num_token_gaps", "token_gaps_s_sum")
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_FIRST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_SUM_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKEN_GAPS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_GAPS_S_SUM_FIELD_NUMBER: _ClassVar[int]
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    num_first_tokens: int
    ttft_s_sum: float
    num_token_gaps: int
    token_gaps_s_sum: float
    def __init__(self, num_requests: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., num_first_tokens: _Optional[int] = ..., ttft_s_sum: _Optional[float] = ..., num_token_gaps: _Optional[int] = ..., token_gaps_s_sum: _Optional[float] = ...) -> None: ...

class ReportRequestsResponse(_message.Message):
    __slots__ = ("accepted",)
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    def __init__(self, accepted: _Optional[bool] = ...) -> None: ...

class NodeStatus(_message.Message):
    __slots__ = ("info", "state", "seconds_since_heartbeat", "num_routed")
    INFO_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    SECONDS_SINCE_HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    NUM_ROUTED_FIELD_NUMBER: _ClassVar[int]
    info: _common_pb2.NodeInfo
    state: str
    seconds_since_heartbeat: float
    num_routed: int
    def __init__(self, info: _Optional[_Union[_common_pb2.NodeInfo, _Mapping]] = ..., state: _Optional[str] = ..., seconds_since_heartbeat: _Optional[float] = ..., num_routed: _Optional[int] = ...) -> None: ...

class ListNodesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListNodesResponse(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeStatus]
    def __init__(self, nodes: _Optional[_Iterable[_Union[NodeStatus, _Mapping]]] = ...) -> None: ...

class DrainNodeRequest(_message.Message):
    __slots__ = ("node_id",)
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    def __init__(self, node_id: _Optional[str] = ...) -> None: ...

class DrainNodeResponse(_message.Message):
    __slots__ = ("node",)
    NODE_FIELD_NUMBER: _ClassVar[int]
    node: NodeStatus
    def __init__(self, node: _Optional[_Union[NodeStatus, _Mapping]] = ...) -> None: ...

class UndrainNodeRequest(_message.Message):
    __slots__ = ("node_id",)
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    def __init__(self, node_id: _Optional[str] = ...) -> None: ...

class UndrainNodeResponse(_message.Message):
    __slots__ = ("node",)
    NODE_FIELD_NUMBER: _ClassVar[int]
    node: NodeStatus
    def __init__(self, node: _Optional[_Union[NodeStatus, _Mapping]] = ...) -> None: ...

class RemoveNodeRequest(_message.Message):
    __slots__ = ("node_id",)
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    def __init__(self, node_id: _Optional[str] = ...) -> None: ...

class RemoveNodeResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetPolicyRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SetPolicyRequest(_message.Message):
    __slots__ = ("policy",)
    POLICY_FIELD_NUMBER: _ClassVar[int]
    policy: str
    def __init__(self, policy: _Optional[str] = ...) -> None: ...

class PolicyResponse(_message.Message):
    __slots__ = ("policy", "allowed")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_FIELD_NUMBER: _ClassVar[int]
    policy: str
    allowed: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, policy: _Optional[str] = ..., allowed: _Optional[_Iterable[str]] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeRouteCount(_message.Message):
    __slots__ = ("node_id", "role", "num_routed")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NUM_ROUTED_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    role: str
    num_routed: int
    def __init__(self, node_id: _Optional[str] = ..., role: _Optional[str] = ..., num_routed: _Optional[int] = ...) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("policy", "num_routed", "num_local_prefill", "nodes", "free_blocks", "total_blocks")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    NUM_ROUTED_FIELD_NUMBER: _ClassVar[int]
    NUM_LOCAL_PREFILL_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    policy: str
    num_routed: int
    num_local_prefill: int
    nodes: _containers.RepeatedCompositeFieldContainer[NodeRouteCount]
    free_blocks: int
    total_blocks: int
    def __init__(self, policy: _Optional[str] = ..., num_routed: _Optional[int] = ..., num_local_prefill: _Optional[int] = ..., nodes: _Optional[_Iterable[_Union[NodeRouteCount, _Mapping]]] = ..., free_blocks: _Optional[int] = ..., total_blocks: _Optional[int] = ...) -> None: ...

class GetPlannerRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PlannerInputs(_message.Message):
    __slots__ = ("interval_s", "num_requests", "request_rate", "mean_prompt_tokens", "mean_output_tokens", "prefix_hit_rate", "prefill_queue_tokens", "decode_kv_usage", "observed_ttft_s", "observed_itl_s", "prefill_nodes", "decode_nodes")
    INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_RATE_FIELD_NUMBER: _ClassVar[int]
    MEAN_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MEAN_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_QUEUE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DECODE_KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_TTFT_S_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_ITL_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_NODES_FIELD_NUMBER: _ClassVar[int]
    DECODE_NODES_FIELD_NUMBER: _ClassVar[int]
    interval_s: float
    num_requests: int
    request_rate: float
    mean_prompt_tokens: float
    mean_output_tokens: float
    prefix_hit_rate: float
    prefill_queue_tokens: int
    decode_kv_usage: float
    observed_ttft_s: float
    observed_itl_s: float
    prefill_nodes: int
    decode_nodes: int
    def __init__(self, interval_s: _Optional[float] = ..., num_requests: _Optional[int] = ..., request_rate: _Optional[float] = ..., mean_prompt_tokens: _Optional[float] = ..., mean_output_tokens: _Optional[float] = ..., prefix_hit_rate: _Optional[float] = ..., prefill_queue_tokens: _Optional[int] = ..., decode_kv_usage: _Optional[float] = ..., observed_ttft_s: _Optional[float] = ..., observed_itl_s: _Optional[float] = ..., prefill_nodes: _Optional[int] = ..., decode_nodes: _Optional[int] = ...) -> None: ...

class PlannerRole(_message.Message):
    __slots__ = ("role", "current_nodes", "wanted_nodes", "desired_nodes", "reason")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CURRENT_NODES_FIELD_NUMBER: _ClassVar[int]
    WANTED_NODES_FIELD_NUMBER: _ClassVar[int]
    DESIRED_NODES_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    role: str
    current_nodes: int
    wanted_nodes: int
    desired_nodes: int
    reason: str
    def __init__(self, role: _Optional[str] = ..., current_nodes: _Optional[int] = ..., wanted_nodes: _Optional[int] = ..., desired_nodes: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class GetPlannerResponse(_message.Message):
    __slots__ = ("enabled", "interval_s", "ttft_slo_ms", "itl_slo_ms", "min_nodes", "max_nodes", "profile", "num_decisions", "seconds_since_decision", "inputs", "roles")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    TTFT_SLO_MS_FIELD_NUMBER: _ClassVar[int]
    ITL_SLO_MS_FIELD_NUMBER: _ClassVar[int]
    MIN_NODES_FIELD_NUMBER: _ClassVar[int]
    MAX_NODES_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    NUM_DECISIONS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_SINCE_DECISION_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    ROLES_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    interval_s: float
    ttft_slo_ms: float
    itl_slo_ms: float
    min_nodes: int
    max_nodes: int
    profile: str
    num_decisions: int
    seconds_since_decision: float
    inputs: PlannerInputs
    roles: _containers.RepeatedCompositeFieldContainer[PlannerRole]
    def __init__(self, enabled: _Optional[bool] = ..., interval_s: _Optional[float] = ..., ttft_slo_ms: _Optional[float] = ..., itl_slo_ms: _Optional[float] = ..., min_nodes: _Optional[int] = ..., max_nodes: _Optional[int] = ..., profile: _Optional[str] = ..., num_decisions: _Optional[int] = ..., seconds_since_decision: _Optional[float] = ..., inputs: _Optional[_Union[PlannerInputs, _Mapping]] = ..., roles: _Optional[_Iterable[_Union[PlannerRole, _Mapping]]] = ...) -> None: ...
