"""Turning "copy these blocks into those blocks" into byte-range writes (push) or reads (pull).

Address arithmetic (strides in bytes, from KVLayout):

    kv_cache [num_layers, planes, num_blocks, block_size, num_kv_heads, head_dim] (2 planes, K and V;
             MLA's 1, or a split latent's 2 of their own widths: KVLayout.plane_width)

    base_address
    |
    v
    +-- layer 0 --------------------------------+-- layer 1 ---------- ...
    | K: [blk 0][blk 1][blk 2] ... [blk N-1]    |
    | V: [blk 0][blk 1][blk 2] ... [blk N-1]    |
    +-------------------------------------------+--------------------- ...
         <-->  block_bytes = block_size * num_kv_heads * head_dim * itemsize

    address(layer, kv, b) = base + layer * strides[0] + kv * strides[1] + b * plane_block_bytes(kv)

(MLA's split latent: plane 0 c_kv, plane 1 k_pe, each plane's blocks of its own width.)

Source ids [4, 5, 6, 9] -> destination ids [0, 1, 2, 3] form two runs, ([4, 5, 6] -> [0, 1, 2])
and ([9] -> [3]): a run is a maximal stretch where both the source and the destination ids
go up by one, so it is one contiguous range on each side. Each (layer, k/v, run) becomes one
(local_address, remote_address, run_length * the plane's block bytes) write, in the order
layer, then K before V, then run.

Reads are the same plan with the roles swapped: the peer's blocks are the source, the local
ones the destination, and each range is (local_address = destination, remote_address =
source, length), in the same order. `KVSender.send_blocks` pushes with one batched write,
`KVSender.fetch_blocks` pulls with one batched read (a client of a KV store pulling blocks
out of the store's registered cache).
"""
from __future__ import annotations

from collections.abc import Sequence

from common.transfer.base import TransferEngine
from common.kv_layout import KVLayout


def block_runs(src_block_ids: Sequence[int], dst_block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Maximal (src_start, dst_start, num_blocks) runs, in the order given."""
    runs: list[list[int]] = []
    for s, d in zip(src_block_ids, dst_block_ids):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [tuple(r) for r in runs]


def _check_ids(name: str, block_ids: Sequence[int], num_blocks: int) -> None:
    bad = [b for b in block_ids if not 0 <= b < num_blocks]
    if bad:
        raise ValueError(f"{name} {bad[:8]} outside [0, {num_blocks})")


def _checked(src: KVLayout, dst: KVLayout, src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
             layers: Sequence[int] | None, last_block_tokens: int | None) -> Sequence[int]:
    """The layers to copy (default: all); ValueError on unequal id counts, ids or layers
    out of range, a destination id given twice, or last_block_tokens outside [1, block_size]."""
    if len(src_block_ids) != len(dst_block_ids):
        raise ValueError(f"{len(src_block_ids)} source block ids but {len(dst_block_ids)} destination ids")
    _check_ids("src_block_ids", src_block_ids, src.num_blocks)
    _check_ids("dst_block_ids", dst_block_ids, dst.num_blocks)
    if len(set(dst_block_ids)) != len(dst_block_ids):
        raise ValueError(f"dst_block_ids has duplicates: {list(dst_block_ids)}")
    layers = range(src.num_layers) if layers is None else layers
    bad_layers = [layer for layer in layers if not 0 <= layer < src.num_layers]
    if bad_layers:
        raise ValueError(f"layers {bad_layers} outside [0, {src.num_layers})")
    if last_block_tokens is not None and not 1 <= last_block_tokens <= src.block_size:
        raise ValueError(f"last_block_tokens must be in [1, {src.block_size}], got {last_block_tokens}")
    return layers


def plan_block_writes(src: KVLayout, dst: KVLayout, src_block_ids: Sequence[int],
                      dst_block_ids: Sequence[int], layers: Sequence[int] | None = None,
                      last_block_tokens: int | None = None) -> list[tuple[int, int, int]]:
    """(local_address, remote_address, length) writes copying src blocks into dst blocks for
    the given layers (default: all). last_block_tokens: copy only the first that many token
    slots of the last block (a prompt's partial tail: the receiver writes the rest itself,
    so the rest must never be overwritten). Pure; ValueError on incompatible layouts,
    unequal id counts, ids or layers out of range, a destination id given twice, or
    last_block_tokens outside [1, block_size]."""
    src.check_compatible(dst)
    layers = _checked(src, dst, src_block_ids, dst_block_ids, layers, last_block_tokens)
    runs = block_runs(src_block_ids, dst_block_ids)
    untouched = 0 if last_block_tokens is None else src.block_size - last_block_tokens
    last = len(runs) - 1
    sizes = [src.plane_block_bytes(kv) for kv in range(src.planes)]     # a split latent's differ
    return [(src.block_address(layer, kv, s), dst.block_address(layer, kv, d),
             n * sizes[kv] - (untouched * sizes[kv] // src.block_size if i == last else 0))
            for layer in layers for kv in range(src.planes) for i, (s, d, n) in enumerate(runs)]


def plan_head_slice_writes(src: KVLayout, dst: KVLayout, head_offset: int, src_block_ids: Sequence[int],
                           dst_block_ids: Sequence[int], layers: Sequence[int] | None = None,
                           last_block_tokens: int | None = None) -> list[tuple[int, int, int]]:
    """Writes copying src blocks, which hold src.num_kv_heads heads, into heads
    [head_offset, head_offset + src.num_kv_heads) of dst blocks holding more heads: a
    tensor-parallel prefill rank writing its share of a decode rank's heads
    (common/transfer/tp_pairing.py). In the [block_size, heads, head_dim] block layout the
    slice of one token slot is contiguous on both sides but the slots are strided on the
    destination, so each (layer, K/V, block) is one write per token slot: block_size
    writes (last_block_tokens for a partial last block), each of src.num_kv_heads *
    head_dim items. With as many heads on both sides (head_offset 0) this is
    plan_block_writes. Pure; ValueError as plan_block_writes, or when the slice does not
    fit the destination's heads."""
    if src.num_kv_heads == dst.num_kv_heads and head_offset == 0:
        return plan_block_writes(src, dst, src_block_ids, dst_block_ids, layers, last_block_tokens)
    src.check_compatible(dst, same_heads=False)
    if src.is_latent:
        raise ValueError(f"a {src.kind} cache has one head on every rank: it is copied whole, never by head slices")
    if not 0 <= head_offset <= dst.num_kv_heads - src.num_kv_heads:
        raise ValueError(f"heads [{head_offset}, {head_offset + src.num_kv_heads}) do not fit the "
                         f"destination's {dst.num_kv_heads} KV heads")
    layers = _checked(src, dst, src_block_ids, dst_block_ids, layers, last_block_tokens)
    slot_src, slot_dst = src.block_bytes // src.block_size, dst.block_bytes // dst.block_size
    length = slot_src
    offset = head_offset * src.head_dim * src.itemsize
    last = len(src_block_ids) - 1
    return [(src.block_address(layer, kv, s) + t * slot_src, dst.block_address(layer, kv, d) + t * slot_dst + offset,
             length)
            for layer in layers for kv in range(src.planes) for i, (s, d) in enumerate(zip(src_block_ids, dst_block_ids))
            for t in range(last_block_tokens if i == last and last_block_tokens is not None else src.block_size)]


def plan_block_reads(src: KVLayout, dst: KVLayout, src_block_ids: Sequence[int],
                     dst_block_ids: Sequence[int], layers: Sequence[int] | None = None,
                     ) -> list[tuple[int, int, int]]:
    """(local_address, remote_address, length) reads copying the peer's src blocks into local
    dst blocks: plan_block_writes(src, dst, ...) with each range's addresses swapped. Pure;
    ValueError as plan_block_writes."""
    dst.check_compatible(src)
    return [(d, s, n) for s, d, n in plan_block_writes(src, dst, src_block_ids, dst_block_ids, layers)]


class KVSender:
    """Pushes blocks of the local KV cache into a peer's KV cache with one batched write, or
    pulls a peer's blocks into the local cache with one batched read. Holds no state besides
    its arguments; thread-safe if the engine's write and read are."""

    def __init__(self, engine: TransferEngine, local: KVLayout):
        self.engine = engine
        self.local = local

    def send_blocks(self, peer_endpoint: str, dst_layout: KVLayout, src_block_ids: Sequence[int],
                    dst_block_ids: Sequence[int], layers: Sequence[int] | None = None,
                    last_block_tokens: int | None = None, timeout_s: float | None = None,
                    head_offset: int | None = None) -> int:
        """Copy src blocks (local) into dst blocks (peer); returns bytes written once the peer
        acknowledged all of them. head_offset: the local blocks are heads [head_offset, ..)
        of the peer's (plan_head_slice_writes); None: the same heads on both sides.
        ValueError as plan_block_writes; TransferError from the engine (then nothing is
        known about which bytes arrived), within timeout_s."""
        if head_offset is None:
            batch = plan_block_writes(self.local, dst_layout, src_block_ids, dst_block_ids, layers,
                                      last_block_tokens)
        else:
            batch = plan_head_slice_writes(self.local, dst_layout, head_offset, src_block_ids, dst_block_ids,
                                           layers, last_block_tokens)
        if not batch:
            return 0
        return self.engine.write(peer_endpoint, batch, timeout_s)

    def fetch_blocks(self, peer_endpoint: str, src_layout: KVLayout, src_block_ids: Sequence[int],
                     dst_block_ids: Sequence[int], layers: Sequence[int] | None = None,
                     timeout_s: float | None = None) -> int:
        """Copy src blocks (peer, laid out as src_layout) into dst blocks (local); returns bytes
        read once all of them arrived. ValueError as plan_block_reads; TransferError from the
        engine (then the dst blocks hold unknown bytes), within timeout_s."""
        batch = plan_block_reads(src_layout, self.local, src_block_ids, dst_block_ids, layers)
        if not batch:
            return 0
        return self.engine.read(peer_endpoint, batch, timeout_s)
