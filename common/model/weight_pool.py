"""One rank's loaded weights as one contiguous host buffer: what a weight seed serves and a
loader reads one-sided (issue 31's peer loading; services/node/weight_seed.py and
weight_loader.py move it).

    pool = WeightPool.of_model(model)          after a disk load, before prepare_linears:
                                               every parameter is copied in and becomes a
                                               view of the pool (no second copy)
    pool = WeightPool.for_manifest(model, m)   a loader: ManifestMismatch unless m lists
                                               exactly the model's parameters; empty bytes
    ... read each bucket into pool.bucket(i), pool.verify(i) ...
    pool.bind(model)                           the parameters become views of the pool

The layout is the model's `named_parameters()` in order, each at an offset aligned to
ALIGN bytes, in the form the checkpoint loaded them (before any backend's post-processing:
a loader post-processes as after a disk load). The pool is cut into buckets of
bucket_bytes (the last one shorter), each with a CHECKSUM digest; a loader verifies every
bucket before a byte of it is used. A backend that packs weights into its own form keeps
the pool as a second copy (CPU float: oneDNN-packed); one that uses the dense tensors
shares them with the pool.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import xxhash

ALIGN = 64
BUCKET_BYTES = 64 << 20
CHECKSUM = "xxh3_128"     # ~15 GB/s a core here (bench/weight_load.py measures it against others)
TENSOR_DTYPES = {name: getattr(torch, name) for name in
                 ("float32", "bfloat16", "float16", "float64", "int8", "uint8", "int32", "int64")}


class ManifestMismatch(ValueError):
    """A seed's manifest does not list exactly this model's parameters (another build of the
    model, another shard, another version of pdmesh): its bytes cannot be used."""


def checksum(data) -> bytes:
    """CHECKSUM of a bytes-like object (a memoryview of a bucket)."""
    return xxhash.xxh3_128_digest(data)


@dataclass(frozen=True)
class TensorEntry:
    name: str
    offset: int
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        n = TENSOR_DTYPES[self.dtype].itemsize
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Manifest:
    tensors: tuple[TensorEntry, ...]
    total_bytes: int
    bucket_bytes: int
    bucket_checksums: tuple[bytes, ...] = ()
    checksum: str = CHECKSUM

    @property
    def num_buckets(self) -> int:
        return -(-self.total_bytes // self.bucket_bytes)

    def bucket_range(self, i: int) -> tuple[int, int]:
        """(offset, length) of bucket i."""
        start = i * self.bucket_bytes
        return start, min(self.bucket_bytes, self.total_bytes - start)

    def buckets(self) -> list[tuple[int, int]]:
        """(offset, length) of every bucket, in order."""
        return [self.bucket_range(i) for i in range(self.num_buckets)]

    def to_proto(self):
        from protos.pdmesh.v1 import weights_pb2
        return weights_pb2.WeightManifest(
            tensors=[weights_pb2.TensorEntry(name=t.name, offset=t.offset, shape=t.shape, dtype=t.dtype)
                     for t in self.tensors],
            total_bytes=self.total_bytes, bucket_bytes=self.bucket_bytes, checksum=self.checksum,
            bucket_checksums=list(self.bucket_checksums))

    @classmethod
    def from_proto(cls, m) -> "Manifest":
        """ManifestMismatch on a manifest that is not self-consistent."""
        bad = next((t for t in m.tensors if t.dtype not in TENSOR_DTYPES), None)
        if bad is not None:
            raise ManifestMismatch(f"tensor {bad.name!r} has dtype {bad.dtype!r}")
        manifest = cls(tuple(TensorEntry(t.name, t.offset, tuple(t.shape), t.dtype) for t in m.tensors),
                       m.total_bytes, m.bucket_bytes, tuple(m.bucket_checksums), m.checksum)
        if m.checksum != CHECKSUM:
            raise ManifestMismatch(f"checksum {m.checksum!r}, expected {CHECKSUM!r}")
        if m.bucket_bytes <= 0 or m.total_bytes < 0 or len(m.bucket_checksums) != manifest.num_buckets:
            raise ManifestMismatch(f"{len(m.bucket_checksums)} bucket checksums for {m.total_bytes} bytes in "
                                   f"buckets of {m.bucket_bytes}")
        return manifest


def layout_of(model: torch.nn.Module) -> tuple[tuple[TensorEntry, ...], int]:
    """Every parameter of model at its offset in a pool; (entries, total bytes)."""
    entries, offset = [], 0
    for name, param in model.named_parameters():
        entry = TensorEntry(name, offset, tuple(param.shape), str(param.dtype).removeprefix("torch."))
        entries.append(entry)
        offset += -(-entry.nbytes // ALIGN) * ALIGN
    return tuple(entries), offset


class WeightPool:
    def __init__(self, buffer: torch.Tensor, manifest: Manifest):
        self.buffer, self.manifest = buffer, manifest

    @property
    def address(self) -> int:
        return self.buffer.data_ptr()

    @property
    def nbytes(self) -> int:
        return self.manifest.total_bytes

    @classmethod
    @torch.no_grad()    # not inference_mode: the buffer stays a normal tensor (tests flip its bytes)
    def of_model(cls, model: torch.nn.Module, bucket_bytes: int = BUCKET_BYTES) -> "WeightPool":
        """model's parameters (on the CPU, as loaded) copied into a new pool, each then a
        view of it; the buckets' checksums computed."""
        entries, total = layout_of(model)
        buffer = torch.empty(max(total, 1), dtype=torch.uint8)
        params = dict(model.named_parameters())
        for entry in entries:
            param = params[entry.name]
            if param.device.type != "cpu":
                raise ValueError(f"{entry.name} is on {param.device}: a pool is made before the model moves")
            view = _view(buffer, entry)
            view.copy_(param.data)
            param.data = view
        pool = cls(buffer, Manifest(entries, total, bucket_bytes))
        pool.manifest = Manifest(entries, total, bucket_bytes,
                                 tuple(pool.bucket_checksum(i) for i in range(pool.manifest.num_buckets)))
        return pool

    @classmethod
    def for_manifest(cls, model: torch.nn.Module, manifest: Manifest) -> "WeightPool":
        """An empty pool to read a seed's buckets into; ManifestMismatch naming the first
        difference unless the manifest lays out exactly model's parameters."""
        entries, total = layout_of(model)
        if manifest.tensors != entries or manifest.total_bytes != total:
            mine = {e.name: e for e in entries}
            for theirs in manifest.tensors:
                if mine.get(theirs.name) != theirs:
                    raise ManifestMismatch(f"the seed has {theirs}, this model "
                                           f"{mine.get(theirs.name, 'no such parameter')}")
            missing = [e.name for e in entries if e not in manifest.tensors]
            raise ManifestMismatch(f"the seed lacks {len(missing)} parameter(s) of this model: "
                                   f"{', '.join(missing[:3])}" if missing else
                                   f"the seed's pool is {manifest.total_bytes} bytes, this model's {total}")
        return cls(torch.empty(max(total, 1), dtype=torch.uint8), manifest)

    def bucket(self, i: int) -> torch.Tensor:
        start, length = self.manifest.bucket_range(i)
        return self.buffer[start:start + length]

    def bucket_checksum(self, i: int) -> bytes:
        return checksum(memoryview(self.bucket(i).numpy()))

    def verify(self, i: int) -> bool:
        return self.bucket_checksum(i) == self.manifest.bucket_checksums[i]

    def failed_buckets(self, threads: int = 2) -> list[int]:
        """The buckets whose bytes do not match their checksums (xxhash releases the GIL:
        `threads` check at once)."""
        n = self.manifest.num_buckets
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="weight-checksums") as pool:
            ok = list(pool.map(self.verify, range(n)))
        return [i for i in range(n) if not ok[i]]

    def changed_tensors(self) -> list[str]:
        """Names of the tensors in buckets whose bytes no longer match their checksums
        (something wrote into the pool after it was made)."""
        bad = [self.manifest.bucket_range(i) for i in self.failed_buckets()]
        return [e.name for e in self.manifest.tensors
                if any(e.offset < start + length and start < e.offset + e.nbytes for start, length in bad)]

    def bind(self, model: torch.nn.Module) -> None:
        """model's parameters become views of this pool (after every bucket verified)."""
        params = dict(model.named_parameters())
        for entry in self.manifest.tensors:
            params[entry.name].data = _view(self.buffer, entry)


def _view(buffer: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
    return buffer[entry.offset:entry.offset + entry.nbytes].view(TENSOR_DTYPES[entry.dtype]).view(entry.shape)
