"""Where a node's KV cache lives in memory, as published to peers.

The cache is one tensor `[num_layers, planes, num_blocks, block_size, num_kv_heads, head_dim]`.
Its `kind` says what the planes are: "kv", two planes (0 = K, 1 = V) of per-head rows; or
"latent", MLA's one plane of one "head" of latent rows (kv_lora_rank + rope wide: every
tensor-parallel rank holds the same, layers/mla.py). An int8 cache (C8) also names its scales (`scales_id`): codes
written under one set of scales are garbage read under another. Layer and K/V strides are free, but each block must be one
contiguous span of `block_bytes` and consecutive blocks must be adjacent (dims 2-5
contiguous), so that a run of blocks is a single byte range.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, fields

from protos.pdmesh.v1 import common_pb2

ITEMSIZE = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1, "uint8": 1,
}
SCALES_ID = re.compile(r"c8:[0-9a-f]{16}")      # formats/msmodelslim.py kv_scales_id
MUST_MATCH = ("kind", "dtype", "scales_id", "num_layers", "block_size", "num_kv_heads", "head_dim")
PLANES = {"kv": 2, "latent": 1}


@dataclass(frozen=True)
class KVLayout:
    dtype: str
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    base_address: int
    strides: tuple[int, ...]
    scales_id: str = ""      # an int8 (C8) cache: which scales its codes mean something under
    kind: str = "kv"         # one of PLANES

    def __post_init__(self) -> None:
        if self.kind not in PLANES:
            raise ValueError(f"kind must be one of {sorted(PLANES)}, got {self.kind!r}")
        if self.dtype not in ITEMSIZE:
            raise ValueError(f"dtype {self.dtype!r} not supported; allowed: {sorted(ITEMSIZE)}")
        if self.scales_id and not SCALES_ID.fullmatch(self.scales_id):
            raise ValueError("scales_id must be empty or 'c8:' and 16 hex digits")
        for name in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.kind == "latent" and self.num_kv_heads != 1:
            raise ValueError(f"num_kv_heads must be 1 for kind 'latent' (one latent row a token), got {self.num_kv_heads}")
        object.__setattr__(self, "strides", tuple(int(s) for s in self.strides))
        item = ITEMSIZE[self.dtype]
        want = (self.block_bytes, self.num_kv_heads * self.head_dim * item, self.head_dim * item, item)
        sizes = (self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        if len(self.strides) != 6 or any(n > 1 and s != w for n, s, w in zip(sizes, self.strides[2:], want)):
            raise ValueError(f"strides {self.strides} must have 6 entries ending in {want} "
                             "(each block contiguous, consecutive blocks adjacent)")

    @classmethod
    def of_tensor(cls, kv_cache, scales_id: str = "") -> KVLayout:
        """Layout of a torch tensor `[L, planes, num_blocks, block_size, heads, head_dim]`
        (2 planes: "kv"; 1: "latent", one head); scales_id: an int8 cache's (the model's
        kv_scales_id)."""
        kind = {2: "kv", 1: "latent"}.get(kv_cache.shape[1]) if kv_cache.dim() == 6 else None
        if kind is None or (kind == "latent" and kv_cache.shape[4] != 1):
            raise ValueError(f"KV cache shape {tuple(kv_cache.shape)} must be [num_layers, 2, num_blocks, "
                             "block_size, num_kv_heads, head_dim] or, latent, [num_layers, 1, num_blocks, "
                             "block_size, 1, width]")
        item = kv_cache.element_size()
        num_layers, _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
        return cls(dtype=str(kv_cache.dtype).removeprefix("torch."), num_layers=num_layers,
                   num_blocks=num_blocks, block_size=block_size, num_kv_heads=num_kv_heads,
                   head_dim=head_dim, base_address=kv_cache.data_ptr(),
                   strides=tuple(s * item for s in kv_cache.stride()), scales_id=scales_id, kind=kind)

    @property
    def planes(self) -> int:
        """The cache's dim 1: K and V, or the one latent plane."""
        return PLANES[self.kind]

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def span_bytes(self) -> int:
        """Bytes from base_address to the end of the last block (what to register)."""
        last = sum((n - 1) * s for n, s in zip((self.num_layers, self.planes, self.num_blocks), self.strides))
        return last + self.block_bytes

    def block_address(self, layer: int, kv: int, block_id: int) -> int:
        if not (0 <= layer < self.num_layers and 0 <= kv < self.planes and 0 <= block_id < self.num_blocks):
            raise ValueError(f"(layer, plane, block_id) = ({layer}, {kv}, {block_id}) outside "
                             f"[0, {self.num_layers}) x [0, {self.planes}) x [0, {self.num_blocks})")
        s = self.strides
        return self.base_address + layer * s[0] + kv * s[1] + block_id * s[2]

    def check_compatible(self, other: KVLayout, same_heads: bool = True) -> None:
        """ValueError naming every field that differs among those a block copy needs equal
        (same_heads=False: all but num_kv_heads, for a copy of a head slice)."""
        diffs = [f"{name} {getattr(self, name)!r} != {getattr(other, name)!r}"
                 for name in MUST_MATCH if (same_heads or name != "num_kv_heads")
                 and getattr(self, name) != getattr(other, name)]
        if diffs:
            raise ValueError("incompatible KV layouts (local vs peer): " + ", ".join(diffs))

    def to_proto(self) -> common_pb2.KVLayout:
        return common_pb2.KVLayout(**{f.name: getattr(self, f.name) for f in fields(self)})

    @classmethod
    def from_proto(cls, msg: common_pb2.KVLayout) -> KVLayout:
        """ValueError naming the field for a layout that cannot be (an unknown kind, ...)."""
        values = {f.name: getattr(msg, f.name) for f in fields(cls) if f.name != "strides"}
        values["kind"] = values["kind"] or "kv"     # a peer from before the field: always K and V
        return cls(**values, strides=tuple(msg.strides))
