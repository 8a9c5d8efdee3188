from protos.pdmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KeySpace(_message.Message):
    __slots__ = ("model_id", "layout", "head_offset")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    HEAD_OFFSET_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    layout: _common_pb2.KVLayout
    head_offset: int
    def __init__(self, model_id: _Optional[str] = ..., layout: _Optional[_Union[_common_pb2.KVLayout, _Mapping]] = ..., head_offset: _Optional[int] = ...) -> None: ...

class StoreRegion(_message.Message):
    __slots__ = ("transfer_backend", "transfer_endpoint", "layout")
    TRANSFER_BACKEND_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    transfer_backend: str
    transfer_endpoint: str
    layout: _common_pb2.KVLayout
    def __init__(self, transfer_backend: _Optional[str] = ..., transfer_endpoint: _Optional[str] = ..., layout: _Optional[_Union[_common_pb2.KVLayout, _Mapping]] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("space", "block_hashes")
    SPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    space: KeySpace
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, space: _Optional[_Union[KeySpace, _Mapping]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("num_hits", "num_memory_hits")
    NUM_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_MEMORY_HITS_FIELD_NUMBER: _ClassVar[int]
    num_hits: int
    num_memory_hits: int
    def __init__(self, num_hits: _Optional[int] = ..., num_memory_hits: _Optional[int] = ...) -> None: ...

class ReservePutRequest(_message.Message):
    __slots__ = ("space", "block_hashes", "token_ids")
    SPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    space: KeySpace
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, space: _Optional[_Union[KeySpace, _Mapping]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ReservePutResponse(_message.Message):
    __slots__ = ("put_id", "indices", "slot_ids", "region", "lease_seconds")
    PUT_ID_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    SLOT_IDS_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    put_id: str
    indices: _containers.RepeatedScalarFieldContainer[int]
    slot_ids: _containers.RepeatedScalarFieldContainer[int]
    region: StoreRegion
    lease_seconds: float
    def __init__(self, put_id: _Optional[str] = ..., indices: _Optional[_Iterable[int]] = ..., slot_ids: _Optional[_Iterable[int]] = ..., region: _Optional[_Union[StoreRegion, _Mapping]] = ..., lease_seconds: _Optional[float] = ...) -> None: ...

class CommitPutRequest(_message.Message):
    __slots__ = ("put_id",)
    PUT_ID_FIELD_NUMBER: _ClassVar[int]
    put_id: str
    def __init__(self, put_id: _Optional[str] = ...) -> None: ...

class CommitPutResponse(_message.Message):
    __slots__ = ("num_committed",)
    NUM_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    num_committed: int
    def __init__(self, num_committed: _Optional[int] = ...) -> None: ...

class PinGetRequest(_message.Message):
    __slots__ = ("space", "block_hashes", "token_ids", "pin_id")
    SPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PIN_ID_FIELD_NUMBER: _ClassVar[int]
    space: KeySpace
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    pin_id: str
    def __init__(self, space: _Optional[_Union[KeySpace, _Mapping]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., token_ids: _Optional[_Iterable[int]] = ..., pin_id: _Optional[str] = ...) -> None: ...

class PinGetResponse(_message.Message):
    __slots__ = ("pin_id", "slot_ids", "region", "lease_seconds", "num_promoted", "generations")
    PIN_ID_FIELD_NUMBER: _ClassVar[int]
    SLOT_IDS_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMOTED_FIELD_NUMBER: _ClassVar[int]
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    pin_id: str
    slot_ids: _containers.RepeatedScalarFieldContainer[int]
    region: StoreRegion
    lease_seconds: float
    num_promoted: int
    generations: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, pin_id: _Optional[str] = ..., slot_ids: _Optional[_Iterable[int]] = ..., region: _Optional[_Union[StoreRegion, _Mapping]] = ..., lease_seconds: _Optional[float] = ..., num_promoted: _Optional[int] = ..., generations: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("pin_id", "slot_ids", "generations")
    PIN_ID_FIELD_NUMBER: _ClassVar[int]
    SLOT_IDS_FIELD_NUMBER: _ClassVar[int]
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    pin_id: str
    slot_ids: _containers.RepeatedScalarFieldContainer[int]
    generations: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, pin_id: _Optional[str] = ..., slot_ids: _Optional[_Iterable[int]] = ..., generations: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("valid",)
    VALID_FIELD_NUMBER: _ClassVar[int]
    valid: bool
    def __init__(self, valid: _Optional[bool] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("blocks_used", "blocks_total", "blocks_pinned", "hits", "misses", "evictions", "bytes_in", "bytes_out", "expired_reservations", "num_spaces", "redis_configured", "redis_up", "redis_spilled", "redis_promoted", "redis_errors", "redis_last_error", "expired_pins")
    BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_PINNED_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPACES_FIELD_NUMBER: _ClassVar[int]
    REDIS_CONFIGURED_FIELD_NUMBER: _ClassVar[int]
    REDIS_UP_FIELD_NUMBER: _ClassVar[int]
    REDIS_SPILLED_FIELD_NUMBER: _ClassVar[int]
    REDIS_PROMOTED_FIELD_NUMBER: _ClassVar[int]
    REDIS_ERRORS_FIELD_NUMBER: _ClassVar[int]
    REDIS_LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_PINS_FIELD_NUMBER: _ClassVar[int]
    blocks_used: int
    blocks_total: int
    blocks_pinned: int
    hits: int
    misses: int
    evictions: int
    bytes_in: int
    bytes_out: int
    expired_reservations: int
    num_spaces: int
    redis_configured: bool
    redis_up: bool
    redis_spilled: int
    redis_promoted: int
    redis_errors: int
    redis_last_error: str
    expired_pins: int
    def __init__(self, blocks_used: _Optional[int] = ..., blocks_total: _Optional[int] = ..., blocks_pinned: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ..., expired_reservations: _Optional[int] = ..., num_spaces: _Optional[int] = ..., redis_configured: _Optional[bool] = ..., redis_up: _Optional[bool] = ..., redis_spilled: _Optional[int] = ..., redis_promoted: _Optional[int] = ..., redis_errors: _Optional[int] = ..., redis_last_error: _Optional[str] = ..., expired_pins: _Optional[int] = ...) -> None: ...
