"""Where a node's KV cache lives in memory, as published to peers.

A layer of the cache holds `planes` planes of `num_blocks` blocks of `block_size` token rows,
each row num_kv_heads x (the plane's width). Its `kind` says what the planes are:
  "kv"            two planes (0 = K, 1 = V) of per-head rows, head_dim wide: one tensor
                  `[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`;
  "latent"        MLA's one plane of one "head" of latent rows, head_dim = kv_lora_rank + rope
                  wide (c_kv then k_pe): `[num_layers, 1, num_blocks, block_size, 1, head_dim]`;
  "latent_split"  MLA's latent as two planes, c_kv rows head_dim (kv_lora_rank) wide then
                  k_pe rows rope_dim wide, each plane of a layer contiguous: what the NPU's
                  MLA attention reads (kernels/npu_mla.py; common/runner/split_latent_cache.py).
Every tensor-parallel rank holds the same latent (layers/mla.py). An int8 cache (C8) also
names its scales (`scales_id`): codes written under one set of scales are garbage read under
another. Layer and plane strides are free, but each block of a plane must be one contiguous
span of `plane_block_bytes(plane)` and consecutive blocks must be adjacent, so that a run of
blocks is a single byte range. `strides` are the byte strides of
[layer, plane, block, row, head, item] (a split latent's: of its c_kv plane; the k_pe plane's
rows are rope_dim items).
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
MUST_MATCH = ("kind", "dtype", "scales_id", "num_layers", "block_size", "num_kv_heads", "head_dim", "rope_dim")
PLANES = {"kv": 2, "latent": 1, "latent_split": 2}
LATENT_KINDS = ("latent", "latent_split")     # MLA's: one head, the same on every rank


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
    rope_dim: int = 0        # "latent_split": the k_pe plane's width; 0 otherwise

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
        if self.kind in LATENT_KINDS and self.num_kv_heads != 1:
            raise ValueError(f"num_kv_heads must be 1 for kind {self.kind!r} (one latent row a token), "
                             f"got {self.num_kv_heads}")
        if (self.kind == "latent_split") != (self.rope_dim > 0) or self.rope_dim < 0:
            raise ValueError(f"rope_dim must be > 0 for kind 'latent_split' and 0 otherwise, got {self.rope_dim} "
                             f"for kind {self.kind!r}")
        object.__setattr__(self, "strides", tuple(int(s) for s in self.strides))
        item = ITEMSIZE[self.dtype]
        want = (self.block_bytes, self.num_kv_heads * self.head_dim * item, self.head_dim * item, item)
        sizes = (self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        if len(self.strides) != 6 or any(n > 1 and s != w for n, s, w in zip(sizes, self.strides[2:], want)):
            raise ValueError(f"strides {self.strides} must have 6 entries ending in {want} "
                             "(each block contiguous, consecutive blocks adjacent)")
        if self.kind == "latent_split":
            plane0, plane1 = (self.num_blocks * self.plane_block_bytes(p) for p in (0, 1))
            if self.strides[1] < plane0 or self.num_layers > 1 and self.strides[0] < self.strides[1] + plane1:
                raise ValueError(f"strides {self.strides}: a layer's c_kv plane ({plane0} bytes) and k_pe plane "
                                 f"({plane1} bytes) must not overlap each other or the next layer")

    @classmethod
    def of_cache(cls, kv_cache, scales_id: str = "") -> KVLayout:
        """Layout of a model's KV cache: a torch tensor (of_tensor) or a SplitLatentCache
        (common/runner/split_latent_cache.py); scales_id: an int8 cache's (the model's
        kv_scales_id)."""
        if hasattr(kv_cache, "kv_layout"):
            return kv_cache.kv_layout()
        return cls.of_tensor(kv_cache, scales_id)

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
        """K and V, the one latent plane, or a split latent's c_kv and k_pe."""
        return PLANES[self.kind]

    @property
    def is_latent(self) -> bool:
        """MLA's cache (one latent head, the same on every tensor-parallel rank)."""
        return self.kind in LATENT_KINDS

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of plane 0 (of every plane but a split latent's k_pe)."""
        return self.plane_block_bytes(0)

    def plane_width(self, plane: int) -> int:
        """Items of one head's row in the plane."""
        return self.rope_dim if self.kind == "latent_split" and plane == 1 else self.head_dim

    def plane_block_bytes(self, plane: int) -> int:
        return self.block_size * self.num_kv_heads * self.plane_width(plane) * self.itemsize

    @property
    def layer_block_bytes(self) -> int:
        """Bytes of one block in one layer, all planes."""
        return sum(self.plane_block_bytes(p) for p in range(self.planes))

    @property
    def span_bytes(self) -> int:
        """Bytes from base_address to the end of the last block (what to register)."""
        return max(self.block_address(self.num_layers - 1, p, self.num_blocks - 1) + self.plane_block_bytes(p)
                   for p in range(self.planes)) - self.base_address

    def block_address(self, layer: int, kv: int, block_id: int) -> int:
        if not (0 <= layer < self.num_layers and 0 <= kv < self.planes and 0 <= block_id < self.num_blocks):
            raise ValueError(f"(layer, plane, block_id) = ({layer}, {kv}, {block_id}) outside "
                             f"[0, {self.num_layers}) x [0, {self.planes}) x [0, {self.num_blocks})")
        s = self.strides
        return self.base_address + layer * s[0] + kv * s[1] + block_id * self.plane_block_bytes(kv)

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
