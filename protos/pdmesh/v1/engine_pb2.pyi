from protos.pdmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "prefill", "client_request_id", "prefill_fallbacks", "resume_position")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    CLIENT_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    RESUME_POSITION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    prefill: _common_pb2.NodeInfo
    client_request_id: str
    prefill_fallbacks: _containers.RepeatedCompositeFieldContainer[_common_pb2.NodeInfo]
    resume_position: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., prefill: _Optional[_Union[_common_pb2.NodeInfo, _Mapping]] = ..., client_request_id: _Optional[str] = ..., prefill_fallbacks: _Optional[_Iterable[_Union[_common_pb2.NodeInfo, _Mapping]]] = ..., resume_position: _Optional[int] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("token_ids", "finish_reason", "usage", "prefill_timing", "logprobs", "prompt_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TIMING_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    usage: _common_pb2.Usage
    prefill_timing: _common_pb2.PrefillTiming
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., prefill_timing: _Optional[_Union[_common_pb2.PrefillTiming, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class KVDestination(_message.Message):
    __slots__ = ("node_id", "transfer_endpoint", "layout", "block_ids", "num_cached_tokens")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    transfer_endpoint: str
    layout: _common_pb2.KVLayout
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_cached_tokens: int
    def __init__(self, node_id: _Optional[str] = ..., transfer_endpoint: _Optional[str] = ..., layout: _Optional[_Union[_common_pb2.KVLayout, _Mapping]] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_cached_tokens: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "destination", "resume_position")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    RESUME_POSITION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    destination: KVDestination
    resume_position: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., destination: _Optional[_Union[KVDestination, _Mapping]] = ..., resume_position: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_id", "num_cached_tokens", "timing", "bytes_written", "first_token_logprobs")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    num_cached_tokens: int
    timing: _common_pb2.PrefillTiming
    bytes_written: int
    first_token_logprobs: _common_pb2.TokenLogprobs
    def __init__(self, first_token_id: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., timing: _Optional[_Union[_common_pb2.PrefillTiming, _Mapping]] = ..., bytes_written: _Optional[int] = ..., first_token_logprobs: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ...) -> None: ...

class CancelPrefillRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class CancelPrefillResponse(_message.Message):
    __slots__ = ("was_running", "settled")
    WAS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    SETTLED_FIELD_NUMBER: _ClassVar[int]
    was_running: bool
    settled: bool
    def __init__(self, was_running: _Optional[bool] = ..., settled: _Optional[bool] = ...) -> None: ...

class EngineStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineStats(_message.Message):
    __slots__ = ("node_id", "running", "waiting", "used_blocks", "free_blocks", "total_blocks", "pending_transfers", "prefix_hit_tokens", "preemptions", "quarantined_blocks", "kv_remote", "transfer_bytes_written", "transfer_bytes_read", "held", "rank_bytes_written", "kv_blocks_staged", "rank_bytes_read", "borrowed_core_steps", "weights_source", "weights_seed", "weights_bytes", "weight_leases_granted", "weights_load_seconds")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PENDING_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_REMOTE_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    RANK_BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_STAGED_FIELD_NUMBER: _ClassVar[int]
    RANK_BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    BORROWED_CORE_STEPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_SOURCE_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_SEED_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_BYTES_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_LEASES_GRANTED_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    running: int
    waiting: int
    used_blocks: int
    free_blocks: int
    total_blocks: int
    pending_transfers: int
    prefix_hit_tokens: int
    preemptions: int
    quarantined_blocks: int
    kv_remote: int
    transfer_bytes_written: int
    transfer_bytes_read: int
    held: int
    rank_bytes_written: int
    kv_blocks_staged: int
    rank_bytes_read: int
    borrowed_core_steps: int
    weights_source: str
    weights_seed: str
    weights_bytes: int
    weight_leases_granted: int
    weights_load_seconds: float
    def __init__(self, node_id: _Optional[str] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., used_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., total_blocks: _Optional[int] = ..., pending_transfers: _Optional[int] = ..., prefix_hit_tokens: _Optional[int] = ..., preemptions: _Optional[int] = ..., quarantined_blocks: _Optional[int] = ..., kv_remote: _Optional[int] = ..., transfer_bytes_written: _Optional[int] = ..., transfer_bytes_read: _Optional[int] = ..., held: _Optional[int] = ..., rank_bytes_written: _Optional[int] = ..., kv_blocks_staged: _Optional[int] = ..., rank_bytes_read: _Optional[int] = ..., borrowed_core_steps: _Optional[int] = ..., weights_source: _Optional[str] = ..., weights_seed: _Optional[str] = ..., weights_bytes: _Optional[int] = ..., weight_leases_granted: _Optional[int] = ..., weights_load_seconds: _Optional[float] = ...) -> None: ...
