from protos.pdmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RegisterRequest(_message.Message):
    __slots__ = ("node", "ttl_seconds")
    NODE_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    node: _common_pb2.NodeInfo
    ttl_seconds: float
    def __init__(self, node: _Optional[_Union[_common_pb2.NodeInfo, _Mapping]] = ..., ttl_seconds: _Optional[float] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("ttl_seconds",)
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ttl_seconds: float
    def __init__(self, ttl_seconds: _Optional[float] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("node_id", "load")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    load: _common_pb2.NodeLoad
    def __init__(self, node_id: _Optional[str] = ..., load: _Optional[_Union[_common_pb2.NodeLoad, _Mapping]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DeregisterRequest(_message.Message):
    __slots__ = ("node_id",)
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    def __init__(self, node_id: _Optional[str] = ...) -> None: ...

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
    __slots__ = ("decode", "prefill", "local_prefill")
    DECODE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_FIELD_NUMBER: _ClassVar[int]
    decode: _common_pb2.NodeInfo
    prefill: _common_pb2.NodeInfo
    local_prefill: bool
    def __init__(self, decode: _Optional[_Union[_common_pb2.NodeInfo, _Mapping]] = ..., prefill: _Optional[_Union[_common_pb2.NodeInfo, _Mapping]] = ..., local_prefill: _Optional[bool] = ...) -> None: ...

class ListMembersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListMembersResponse(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[_common_pb2.NodeInfo]
    def __init__(self, nodes: _Optional[_Iterable[_Union[_common_pb2.NodeInfo, _Mapping]]] = ...) -> None: ...
