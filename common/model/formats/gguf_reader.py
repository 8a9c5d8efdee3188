"""The layout of a GGUF file: its metadata and a read-only byte view of each tensor.

    header    "GGUF", version u32 (2 or 3), tensor_count u64, metadata_count u64
    metadata  metadata_count x (key: string, value_type: u32, value)
    infos     tensor_count x (name: string, n_dims: u32, dims: u64 x n_dims (fastest
              first, i.e. the reverse of torch's order), ggml_type: u32, offset: u64)
    padding   to general.alignment (default 32)
    data      each tensor's bytes at data_start + offset
(little-endian; a string is a u64 length and UTF-8 bytes; an array a u32 item type, a u64
count and the items). gguf.GGUFReader parses the same layout but takes seconds on a
49k-token vocabulary and fails on a truncated file with numpy's errors; this reader takes a
fraction of a second and names what is missing. Values: ints, floats, bools, strings, and
lists of them. Nothing here dequantizes (formats/gguf.py does).

`read_gguf(path)` raises GGUFError (a ValueError naming the file) on a file that is not
GGUF, is truncated (a tensor's bytes reach past the end), or holds a tensor type id that
ggml does not define. The returned GGUFFile is immutable and memory-maps the file.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# value type id -> (struct format, numpy dtype) of the scalar types
_SCALARS = {0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16),
            4: ("<I", np.uint32), 5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_),
            10: ("<Q", np.uint64), 11: ("<q", np.int64), 12: ("<d", np.float64)}
_STRING, _ARRAY = 8, 9


class GGUFError(ValueError):
    """The file is not a readable GGUF file; the message names it and what is wrong."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]      # torch order (rows first): the reverse of the file's dims
    offset: int                 # absolute, in the file
    num_bytes: int

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (the last torch dim, ggml's fastest one)."""
        block, type_size = GGML_QUANT_SIZES[self.ggml_type]
        return self.shape[-1] // block * type_size if self.shape else type_size


@dataclass(frozen=True, eq=False)
class GGUFFile:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]      # in file order
    _data: np.ndarray                   # uint8 memmap of the whole file

    def tensor_bytes(self, info: TensorInfo) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 array [rows..., row_bytes] (a view)."""
        flat = self._data[info.offset:info.offset + info.num_bytes]
        return flat.reshape(*info.shape[:-1], info.row_bytes) if info.shape else flat

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)


class _Cursor:
    def __init__(self, path: Path, buf: memoryview) -> None:
        self.path, self.buf, self.pos = path, buf, 0

    def need(self, num_bytes: int, what: str) -> None:
        if self.pos + num_bytes > len(self.buf):
            raise GGUFError(f"{self.path}: truncated GGUF file: {what} needs bytes up to "
                            f"{self.pos + num_bytes}, the file has {len(self.buf)} "
                            f"(an incomplete download or copy?)")

    def scalar(self, fmt: str, what: str) -> Any:
        size = struct.calcsize(fmt)
        self.need(size, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self, what: str) -> str:
        size = self.scalar("<Q", what)
        self.need(size, what)
        raw = bytes(self.buf[self.pos:self.pos + size])
        self.pos += size
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise GGUFError(f"{self.path}: {what} is not UTF-8 ({e})") from None

    def value(self, value_type: int, what: str) -> Any:
        if value_type in _SCALARS:
            return self.scalar(_SCALARS[value_type][0], what)
        if value_type == _STRING:
            return self.string(what)
        if value_type == _ARRAY:
            item_type, count = self.scalar("<I", what), self.scalar("<Q", what)
            if item_type in _SCALARS:
                dtype = np.dtype(_SCALARS[item_type][1]).newbyteorder("<")
                self.need(count * dtype.itemsize, what)
                items = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
                self.pos += count * dtype.itemsize
                return items.tolist()
            return [self.value(item_type, f"{what}[{i}]") for i in range(count)]
        raise GGUFError(f"{self.path}: {what} has value type {value_type}, not one of GGUF's "
                        f"{sorted([*_SCALARS, _STRING, _ARRAY])}")


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse the header, metadata and tensor infos of a GGUF file (tensor data stays on disk)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such GGUF file")
    data = np.memmap(path, dtype=np.uint8, mode="r") if path.stat().st_size else np.zeros(0, np.uint8)
    cur = _Cursor(path, memoryview(data))
    cur.need(4, "the magic number")
    magic = bytes(cur.buf[:4])
    if magic != MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (starts with {magic!r}, expected {MAGIC!r})")
    cur.pos = 4
    version = cur.scalar("<I", "the version")
    if version not in VERSIONS:
        raise GGUFError(f"{path}: GGUF version {version} is not supported; allowed: {list(VERSIONS)} "
                        f"(a big-endian file reads as a huge version)")
    num_tensors, num_metadata = cur.scalar("<Q", "the header"), cur.scalar("<Q", "the header")
    metadata: dict[str, Any] = {}
    for i in range(num_metadata):
        key = cur.string(f"metadata key #{i}")
        metadata[key] = cur.value(cur.scalar("<I", f"metadata {key!r}"), f"metadata {key!r}")
    infos = []
    for i in range(num_tensors):
        name = cur.string(f"tensor info #{i}")
        num_dims = cur.scalar("<I", f"tensor {name!r}")
        dims = [cur.scalar("<Q", f"tensor {name!r}") for _ in range(num_dims)]
        type_id, offset = cur.scalar("<I", f"tensor {name!r}"), cur.scalar("<Q", f"tensor {name!r}")
        infos.append((name, dims, type_id, offset))
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    data_start = -(-cur.pos // alignment) * alignment
    tensors = {}
    for name, dims, type_id, offset in infos:
        info = _tensor_info(path, name, dims, type_id, data_start + offset)
        cur.pos = info.offset
        cur.need(info.num_bytes, f"tensor {name!r}")
        tensors[name] = info
    return GGUFFile(path, version, metadata, tensors, data)


def _tensor_info(path: Path, name: str, dims: list[int], type_id: int, offset: int) -> TensorInfo:
    try:
        ggml_type = GGMLQuantizationType(type_id)
    except ValueError:
        raise GGUFError(f"{path}: tensor {name!r} has ggml type id {type_id}, which ggml does not "
                        f"define; known: {[t.name for t in GGMLQuantizationType]}") from None
    block, type_size = GGML_QUANT_SIZES[ggml_type]
    if dims and dims[0] % block:
        raise GGUFError(f"{path}: tensor {name!r} of dims {dims} cannot be {ggml_type.name}: its rows "
                        f"of {dims[0]} are not a multiple of the block size {block}")
    num_elements = int(np.prod(dims)) if dims else 1
    return TensorInfo(name, ggml_type, tuple(reversed(dims)), offset, num_elements // block * type_size)
