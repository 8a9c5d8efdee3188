from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WriteChunk(_message.Message):
    __slots__ = ("remote_address", "data")
    REMOTE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    remote_address: int
    data: bytes
    def __init__(self, remote_address: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class WriteAck(_message.Message):
    __slots__ = ("bytes_written",)
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    bytes_written: int
    def __init__(self, bytes_written: _Optional[int] = ...) -> None: ...

class ReadRange(_message.Message):
    __slots__ = ("remote_address", "length")
    REMOTE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    remote_address: int
    length: int
    def __init__(self, remote_address: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class ReadRequest(_message.Message):
    __slots__ = ("ranges", "chunk_bytes")
    RANGES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    ranges: _containers.RepeatedCompositeFieldContainer[ReadRange]
    chunk_bytes: int
    def __init__(self, ranges: _Optional[_Iterable[_Union[ReadRange, _Mapping]]] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class ReadChunk(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...
