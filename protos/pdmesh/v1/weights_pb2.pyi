from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OpenWeightsRequest(_message.Message):
    __slots__ = ("identity", "tensor_parallel_size", "loader_node_id")
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    LOADER_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    identity: str
    tensor_parallel_size: int
    loader_node_id: str
    def __init__(self, identity: _Optional[str] = ..., tensor_parallel_size: _Optional[int] = ..., loader_node_id: _Optional[str] = ...) -> None: ...

class OpenWeightsResponse(_message.Message):
    __slots__ = ("lease_id", "lease_s", "ranks")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    lease_s: float
    ranks: _containers.RepeatedCompositeFieldContainer[RankWeights]
    def __init__(self, lease_id: _Optional[str] = ..., lease_s: _Optional[float] = ..., ranks: _Optional[_Iterable[_Union[RankWeights, _Mapping]]] = ...) -> None: ...

class RankWeights(_message.Message):
    __slots__ = ("rank", "transfer_endpoint", "base_address", "manifest")
    RANK_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    BASE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    rank: int
    transfer_endpoint: str
    base_address: int
    manifest: WeightManifest
    def __init__(self, rank: _Optional[int] = ..., transfer_endpoint: _Optional[str] = ..., base_address: _Optional[int] = ..., manifest: _Optional[_Union[WeightManifest, _Mapping]] = ...) -> None: ...

class WeightManifest(_message.Message):
    __slots__ = ("tensors", "total_bytes", "bucket_bytes", "checksum", "bucket_checksums")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    BUCKET_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorEntry]
    total_bytes: int
    bucket_bytes: int
    checksum: str
    bucket_checksums: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, tensors: _Optional[_Iterable[_Union[TensorEntry, _Mapping]]] = ..., total_bytes: _Optional[int] = ..., bucket_bytes: _Optional[int] = ..., checksum: _Optional[str] = ..., bucket_checksums: _Optional[_Iterable[bytes]] = ...) -> None: ...

class TensorEntry(_message.Message):
    __slots__ = ("name", "offset", "shape", "dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    offset: int
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    def __init__(self, name: _Optional[str] = ..., offset: _Optional[int] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ...) -> None: ...

class WeightLease(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class RenewWeightsResponse(_message.Message):
    __slots__ = ("lease_s",)
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    lease_s: float
    def __init__(self, lease_s: _Optional[float] = ...) -> None: ...

class CloseWeightsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
