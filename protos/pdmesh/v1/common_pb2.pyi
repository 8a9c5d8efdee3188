from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs", "prompt_logprobs")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    prompt_logprobs: int
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class NodeLoad(_message.Message):
    __slots__ = ("running", "waiting", "free_blocks", "total_blocks", "stalled", "cached_blocks", "quarantined_blocks", "transfer_bytes_written")
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STALLED_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    running: int
    waiting: int
    free_blocks: int
    total_blocks: int
    stalled: bool
    cached_blocks: int
    quarantined_blocks: int
    transfer_bytes_written: int
    def __init__(self, running: _Optional[int] = ..., waiting: _Optional[int] = ..., free_blocks: _Optional[int] = ..., total_blocks: _Optional[int] = ..., stalled: _Optional[bool] = ..., cached_blocks: _Optional[int] = ..., quarantined_blocks: _Optional[int] = ..., transfer_bytes_written: _Optional[int] = ...) -> None: ...

class LayerExpertTokens(_message.Message):
    __slots__ = ("layer", "num_tokens")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    layer: int
    num_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, layer: _Optional[int] = ..., num_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class ExpertTokens(_message.Message):
    __slots__ = ("layers",)
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    layers: _containers.RepeatedCompositeFieldContainer[LayerExpertTokens]
    def __init__(self, layers: _Optional[_Iterable[_Union[LayerExpertTokens, _Mapping]]] = ...) -> None: ...

class KVLayout(_message.Message):
    __slots__ = ("dtype", "num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim", "base_address", "strides", "scales_id", "kind", "rope_dim")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BASE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STRIDES_FIELD_NUMBER: _ClassVar[int]
    SCALES_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    ROPE_DIM_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    base_address: int
    strides: _containers.RepeatedScalarFieldContainer[int]
    scales_id: str
    kind: str
    rope_dim: int
    def __init__(self, dtype: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., base_address: _Optional[int] = ..., strides: _Optional[_Iterable[int]] = ..., scales_id: _Optional[str] = ..., kind: _Optional[str] = ..., rope_dim: _Optional[int] = ...) -> None: ...

class NodeInfo(_message.Message):
    __slots__ = ("node_id", "role", "address", "model_id", "transfer_backend", "transfer_endpoint", "kv_layout", "load", "max_model_len", "transfer_listen_addresses", "tensor_parallel_size", "kv_ranks", "weight_seed")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BACKEND_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_LISTEN_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_RANKS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_SEED_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    role: str
    address: str
    model_id: str
    transfer_backend: str
    transfer_endpoint: str
    kv_layout: KVLayout
    load: NodeLoad
    max_model_len: int
    transfer_listen_addresses: _containers.RepeatedScalarFieldContainer[str]
    tensor_parallel_size: int
    kv_ranks: _containers.RepeatedCompositeFieldContainer[KVRank]
    weight_seed: WeightSeedInfo
    def __init__(self, node_id: _Optional[str] = ..., role: _Optional[str] = ..., address: _Optional[str] = ..., model_id: _Optional[str] = ..., transfer_backend: _Optional[str] = ..., transfer_endpoint: _Optional[str] = ..., kv_layout: _Optional[_Union[KVLayout, _Mapping]] = ..., load: _Optional[_Union[NodeLoad, _Mapping]] = ..., max_model_len: _Optional[int] = ..., transfer_listen_addresses: _Optional[_Iterable[str]] = ..., tensor_parallel_size: _Optional[int] = ..., kv_ranks: _Optional[_Iterable[_Union[KVRank, _Mapping]]] = ..., weight_seed: _Optional[_Union[WeightSeedInfo, _Mapping]] = ...) -> None: ...

class WeightSeedInfo(_message.Message):
    __slots__ = ("identity", "tensor_parallel_size", "total_bytes", "max_clients")
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_CLIENTS_FIELD_NUMBER: _ClassVar[int]
    identity: str
    tensor_parallel_size: int
    total_bytes: int
    max_clients: int
    def __init__(self, identity: _Optional[str] = ..., tensor_parallel_size: _Optional[int] = ..., total_bytes: _Optional[int] = ..., max_clients: _Optional[int] = ...) -> None: ...

class KVRank(_message.Message):
    __slots__ = ("transfer_endpoint", "layout", "listen_addresses")
    TRANSFER_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    LISTEN_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    transfer_endpoint: str
    layout: KVLayout
    listen_addresses: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, transfer_endpoint: _Optional[str] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., listen_addresses: _Optional[_Iterable[str]] = ...) -> None: ...

class PrefillTiming(_message.Message):
    __slots__ = ("queue_ms", "compute_ms", "transfer_ms", "remote")
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_FIELD_NUMBER: _ClassVar[int]
    queue_ms: float
    compute_ms: float
    transfer_ms: float
    remote: bool
    def __init__(self, queue_ms: _Optional[float] = ..., compute_ms: _Optional[float] = ..., transfer_ms: _Optional[float] = ..., remote: _Optional[bool] = ...) -> None: ...
