"""KVLayout address arithmetic, plan_block_writes' exact writes and plan_block_reads' exact reads,
KVSender pushing and fetching over the fake engine."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from common.hashing import layout_key
from common.kv_layout import KVLayout
from common.runner.split_latent_cache import SplitLatentCache
from common.transfer import (KVSender, TransferError, block_runs, plan_block_reads,
                             plan_block_writes)
from common.transfer.kv_writes import plan_head_slice_writes
from common.transfer.fake import FakeTransfer
from services.kv_store.slot_memory import SlotMemory

BB = 256  # block_bytes of the layouts below: block_size 4 x 2 heads x head_dim 8 x 4 bytes


def layout(num_layers=2, num_blocks=8, base=0x10000, **kw) -> KVLayout:
    fields = dict(dtype="float32", num_layers=num_layers, num_blocks=num_blocks, block_size=4,
                  num_kv_heads=2, head_dim=8, base_address=base,
                  strides=(2 * num_blocks * BB, num_blocks * BB, BB, 64, 32, 4))
    fields.update(kw)
    return KVLayout(**fields)


SRC = layout(num_blocks=8, base=0x10000)     # layer stride 4096, K/V stride 2048
DST = layout(num_blocks=10, base=0x80000)    # layer stride 5120, K/V stride 2560


def test_layout_of_tensor_strides_and_addresses():
    kv = torch.zeros(2, 2, 8, 4, 2, 8)
    lay = KVLayout.of_tensor(kv)
    assert lay == replace(SRC, base_address=kv.data_ptr())
    assert lay.strides == (4096, 2048, 256, 64, 32, 4)
    assert lay.block_bytes == BB
    assert lay.span_bytes == kv.numel() * 4
    assert lay.block_address(1, 1, 3) == kv.data_ptr() + 4096 + 2048 + 3 * 256
    assert lay.block_address(1, 1, 3) == kv[1, 1, 3].data_ptr()


def test_layout_rejects_blocks_that_are_not_adjacent():
    with pytest.raises(ValueError, match="strides"):
        KVLayout.of_tensor(torch.zeros(2, 2, 8, 4, 2, 8)[:, :, ::2])
    with pytest.raises(ValueError, match="dtype 'int4' not supported"):
        layout(dtype="int4")
    with pytest.raises(ValueError, match=r"outside \[0, 2\) x \[0, 2\) x \[0, 8\)"):
        SRC.block_address(0, 0, 8)
    with pytest.raises(ValueError, match="kind must be one of \\['kv', 'latent', 'latent_split'\\], got 'mla'"):
        layout(kind="mla")


def test_latent_layout_has_one_plane_and_its_own_hash_key():
    """MLA's cache (layers/mla.py): one plane of one latent head; its writes copy that
    plane only, and its blocks never hash like a K/V cache's of the same shape."""
    cache = torch.zeros(2, 1, 8, 4, 1, 24)
    lay = KVLayout.of_tensor(cache)
    assert (lay.kind, lay.planes, lay.block_bytes) == ("latent", 1, 4 * 24 * 4)
    assert lay.span_bytes == cache.numel() * 4
    assert lay.block_address(1, 0, 3) == cache[1, 0, 3].data_ptr()
    with pytest.raises(ValueError, match=r"outside \[0, 2\) x \[0, 1\) x \[0, 8\)"):
        lay.block_address(0, 1, 0)
    dst = KVLayout.of_tensor(torch.zeros(2, 1, 6, 4, 1, 24))
    writes = plan_block_writes(lay, dst, [4, 5], [0, 1])
    assert writes == [(lay.block_address(layer, 0, 4), dst.block_address(layer, 0, 0), 2 * lay.block_bytes)
                      for layer in (0, 1)]
    as_kv = KVLayout.of_tensor(torch.zeros(2, 2, 8, 4, 1, 24))
    assert layout_key(lay) != layout_key(as_kv) and layout_key(lay).endswith(":latent")
    with pytest.raises(ValueError, match="incompatible KV layouts.*kind 'latent' != 'kv'"):
        lay.check_compatible(as_kv)
    assert KVLayout.from_proto(lay.to_proto()) == lay
    before_the_field = as_kv.to_proto()
    before_the_field.kind = ""                       # a peer from before the field: K and V
    assert KVLayout.from_proto(before_the_field) == as_kv
    with pytest.raises(ValueError, match="num_kv_heads must be 1 for kind 'latent'"):
        replace(lay, num_kv_heads=2, strides=(lay.strides[0], lay.strides[1], 2 * lay.block_bytes, 2 * 96, 96, 4))
    with pytest.raises(ValueError, match=r"latent, \[num_layers, 1, num_blocks, block_size, 1, width\]"):
        KVLayout.of_tensor(torch.zeros(2, 1, 8, 4, 2, 24))


def test_split_latent_layout_addresses_each_plane_and_pushes_exactly_its_blocks(fake_pair):
    """The npu backend's latent cache (common/runner/split_latent_cache.py): per layer a c_kv
    plane then a k_pe plane of another width; a block is one span in each, a run of blocks
    one write a (layer, plane) of that plane's length, a partial last block cut per plane."""
    src = SplitLatentCache(3, 6, 4, 24, 8, torch.float32, torch.device("cpu"))
    dst = SplitLatentCache(3, 9, 4, 24, 8, torch.float32, torch.device("cpu"))
    src.buffer.copy_(torch.randn(src.buffer.shape))
    ls, ld = KVLayout.of_cache(src), KVLayout.of_cache(dst)
    assert (ls.kind, ls.planes, ls.head_dim, ls.rope_dim) == ("latent_split", 2, 24, 8)
    assert [ls.plane_block_bytes(p) for p in (0, 1)] == [4 * 24 * 4, 4 * 8 * 4] and ls.layer_block_bytes == 4 * 32 * 4
    assert ls.span_bytes == src.numel() * 4
    assert ls.block_address(2, 0, 5) == src[2][0][5].data_ptr() and ls.block_address(2, 1, 5) == src[2][1][5].data_ptr()
    writes = plan_block_writes(ls, ld, [1, 2, 4], [7, 8, 0], last_block_tokens=3)
    assert [w[2] for w in writes] == [2 * 384, 384 - 96, 2 * 128, 128 - 32] * 3     # (layer, plane, run)
    a, b = fake_pair
    a.register(ls.base_address, ls.span_bytes)
    b.register(ld.base_address, ld.span_bytes)
    KVSender(a, ls).send_blocks(b.endpoint, ld, [1, 2, 4], [7, 8, 0])
    for plane_src, plane_dst in ((src.nope, dst.nope), (src.rope, dst.rope)):
        want = torch.zeros_like(plane_dst)
        want[:, [7, 8, 0]] = plane_src[:, [1, 2, 4]]
        assert torch.equal(plane_dst, want)
    dst.buffer.fill_(7.0)           # a partial last block: its 4th row stays as it was, in both planes
    KVSender(a, ls).send_blocks(b.endpoint, ld, [1, 2, 4], [7, 8, 0], last_block_tokens=3)
    for plane_src, plane_dst in ((src.nope, dst.nope), (src.rope, dst.rope)):
        assert torch.equal(plane_dst[:, [7, 8]], plane_src[:, [1, 2]])
        assert torch.equal(plane_dst[:, 0, :3], plane_src[:, 4, :3]) and bool((plane_dst[:, 0, 3] == 7.0).all())
    one_plane = KVLayout.of_tensor(torch.zeros(3, 1, 9, 4, 1, 32))
    assert layout_key(ls).endswith(":latent_split:R8") and layout_key(ls) != layout_key(one_plane)
    with pytest.raises(ValueError, match="kind 'latent_split' != 'latent'.*head_dim 24 != 32.*rope_dim 8 != 0"):
        ls.check_compatible(one_plane)
    assert KVLayout.from_proto(ls.to_proto()) == ls
    with pytest.raises(ValueError, match="rope_dim must be > 0 for kind 'latent_split' and 0 otherwise, got 0"):
        replace(ls, rope_dim=0)
    with pytest.raises(ValueError, match="must not overlap"):
        replace(ls, strides=(ls.strides[0], 100, *ls.strides[2:]))
    with pytest.raises(ValueError, match="copied whole, never by head slices"):
        plan_head_slice_writes(ls, replace(ld, num_kv_heads=1), 1, [1], [1])


def test_a_slot_of_the_store_holds_a_split_latent_block_in_layer_plane_order():
    lay = KVLayout.of_cache(SplitLatentCache(2, 3, 4, 24, 8, torch.float32, torch.device("cpu")))
    memory = SlotMemory(lay, 5, FakeTransfer())
    data = bytes(range(256)) * (memory.bytes_per_slot // 256) + bytes(memory.bytes_per_slot % 256)
    memory.write_slot(3, data)
    assert memory.read_slot(3) == data and memory.read_slot(2) == bytes(memory.bytes_per_slot)
    assert memory.layout.block_address(1, 1, 3) - memory.layout.base_address == \
        memory.planes[1][1, 3].data_ptr() - memory.pool.data_ptr()
    memory.transfer.close()


def test_layout_proto_round_trip():
    msg = DST.to_proto()
    assert list(msg.strides) == list(DST.strides) and msg.base_address == 0x80000
    assert KVLayout.from_proto(msg) == DST


def test_check_compatible_names_fields_and_values():
    SRC.check_compatible(DST)  # num_blocks and base may differ
    other = layout(dtype="float16", head_dim=16, strides=(4096, 2048, 256, 64, 32, 2))
    with pytest.raises(ValueError) as exc:
        SRC.check_compatible(other)
    assert "dtype 'float32' != 'float16'" in str(exc.value)
    assert "head_dim 8 != 16" in str(exc.value)
    assert "num_layers" not in str(exc.value)


def test_block_runs():
    assert block_runs([4, 5, 6, 9], [0, 1, 2, 3]) == [(4, 0, 3), (9, 3, 1)]
    assert block_runs([], []) == []


def test_plan_consecutive_ids_merge_into_one_write_per_layer_and_kv():
    assert plan_block_writes(SRC, DST, [0, 1, 2], [5, 6, 7]) == [
        (0x10000, 0x80000 + 5 * BB, 3 * BB),
        (0x10000 + 2048, 0x80000 + 2560 + 5 * BB, 3 * BB),
        (0x10000 + 4096, 0x80000 + 5120 + 5 * BB, 3 * BB),
        (0x10000 + 4096 + 2048, 0x80000 + 5120 + 2560 + 5 * BB, 3 * BB),
    ]


def test_plan_breaks_runs_where_either_side_jumps():
    writes = plan_block_writes(SRC, DST, [0, 1, 3, 4], [4, 5, 6, 9], layers=[1])
    assert writes == [
        (0x10000 + 4096, 0x80000 + 5120 + 4 * BB, 2 * BB),
        (0x10000 + 4096 + 3 * BB, 0x80000 + 5120 + 6 * BB, BB),
        (0x10000 + 4096 + 4 * BB, 0x80000 + 5120 + 9 * BB, BB),
        (0x10000 + 4096 + 2048, 0x80000 + 5120 + 2560 + 4 * BB, 2 * BB),
        (0x10000 + 4096 + 2048 + 3 * BB, 0x80000 + 5120 + 2560 + 6 * BB, BB),
        (0x10000 + 4096 + 2048 + 4 * BB, 0x80000 + 5120 + 2560 + 9 * BB, BB),
    ]


def test_plan_shuffled_ids_one_write_per_block():
    writes = plan_block_writes(SRC, DST, [0, 1, 2], [2, 1, 0], layers=[0])
    assert writes == [
        (0x10000, 0x80000 + 2 * BB, BB), (0x10000 + BB, 0x80000 + BB, BB),
        (0x10000 + 2 * BB, 0x80000, BB),
        (0x10000 + 2048, 0x80000 + 2560 + 2 * BB, BB), (0x10000 + 2048 + BB, 0x80000 + 2560 + BB, BB),
        (0x10000 + 2048 + 2 * BB, 0x80000 + 2560, BB),
    ]
    assert len(plan_block_writes(SRC, DST, [3, 2, 1, 0], [0, 1, 2, 3])) == 2 * 2 * 4


@pytest.mark.parametrize("src_ids, dst_ids, layers, match", [
    ([0, 1], [0], None, "2 source block ids but 1 destination"),
    ([8], [0], None, r"src_block_ids \[8\] outside \[0, 8\)"),
    ([0], [10], None, r"dst_block_ids \[10\] outside \[0, 10\)"),
    ([0, 1], [3, 3], None, "duplicates"),
    ([0], [0], [2], r"layers \[2\] outside \[0, 2\)"),
])
def test_plan_validates(src_ids, dst_ids, layers, match):
    with pytest.raises(ValueError, match=match):
        plan_block_writes(SRC, DST, src_ids, dst_ids, layers)


def test_plan_reads_are_the_writes_with_local_and_remote_swapped():
    # SRC is the peer's cache, DST the local one: each range is (local dst, remote src, length)
    reads = plan_block_reads(SRC, DST, [0, 1, 3, 4], [4, 5, 6, 9], layers=[1])
    assert reads == [
        (0x80000 + 5120 + 4 * BB, 0x10000 + 4096, 2 * BB),
        (0x80000 + 5120 + 6 * BB, 0x10000 + 4096 + 3 * BB, BB),
        (0x80000 + 5120 + 9 * BB, 0x10000 + 4096 + 4 * BB, BB),
        (0x80000 + 5120 + 2560 + 4 * BB, 0x10000 + 4096 + 2048, 2 * BB),
        (0x80000 + 5120 + 2560 + 6 * BB, 0x10000 + 4096 + 2048 + 3 * BB, BB),
        (0x80000 + 5120 + 2560 + 9 * BB, 0x10000 + 4096 + 2048 + 4 * BB, BB),
    ]
    assert plan_block_reads(SRC, DST, [0, 1, 2], [5, 6, 7]) == [
        (0x80000 + 5 * BB, 0x10000, 3 * BB),
        (0x80000 + 2560 + 5 * BB, 0x10000 + 2048, 3 * BB),
        (0x80000 + 5120 + 5 * BB, 0x10000 + 4096, 3 * BB),
        (0x80000 + 5120 + 2560 + 5 * BB, 0x10000 + 4096 + 2048, 3 * BB),
    ]


@pytest.mark.parametrize("src_ids, dst_ids, layers, match", [
    ([8], [0], None, r"src_block_ids \[8\] outside \[0, 8\)"),
    ([0], [10], None, r"dst_block_ids \[10\] outside \[0, 10\)"),
    ([0, 1], [3, 3], None, "dst_block_ids has duplicates"),
    ([0], [0], [2], r"layers \[2\] outside \[0, 2\)"),
])
def test_plan_reads_validate(src_ids, dst_ids, layers, match):
    with pytest.raises(ValueError, match=match):
        plan_block_reads(SRC, DST, src_ids, dst_ids, layers)


def test_plan_reads_name_local_then_peer_values():
    peer = layout(head_dim=16, strides=(8192, 4096, 512, 128, 64, 4))
    with pytest.raises(ValueError, match=r"\(local vs peer\): head_dim 8 != 16"):
        plan_block_reads(peer, DST, [0], [0])


@pytest.fixture
def fake_pair():
    a, b = FakeTransfer(), FakeTransfer()
    yield a, b
    a.close()
    b.close()


def kv_pair(a, b, src_blocks=6, dst_blocks=9):
    torch.manual_seed(0)
    src = torch.randn(3, 2, src_blocks, 4, 2, 8)
    dst = torch.zeros(3, 2, dst_blocks, 4, 2, 8)
    ls, ld = KVLayout.of_tensor(src), KVLayout.of_tensor(dst)
    a.register(ls.base_address, ls.span_bytes)
    b.register(ld.base_address, ld.span_bytes)
    return src, dst, ls, ld


def test_sender_moves_exactly_the_requested_blocks(fake_pair):
    a, b = fake_pair
    src, dst, ls, ld = kv_pair(a, b)
    sent = KVSender(a, ls).send_blocks(b.endpoint, ld, [1, 2, 4], [7, 0, 1])
    assert sent == 3 * 3 * 2 * BB
    assert (a.num_writes, a.num_bytes) == (1, sent)
    expected = torch.zeros_like(dst)
    expected[:, :, [7, 0, 1]] = src[:, :, [1, 2, 4]]
    assert torch.equal(dst, expected)


def test_sender_with_no_blocks_writes_nothing(fake_pair):
    a, b = fake_pair
    _, _, ls, ld = kv_pair(a, b)
    assert KVSender(a, ls).send_blocks(b.endpoint, ld, [], []) == 0
    assert a.num_writes == 0


def test_sender_rejects_incompatible_layout_before_writing(fake_pair):
    a, b = fake_pair
    _, _, ls, _ = kv_pair(a, b)
    other = KVLayout.of_tensor(torch.zeros(3, 2, 9, 4, 2, 16))
    with pytest.raises(ValueError, match="head_dim 8 != 16"):
        KVSender(a, ls).send_blocks(b.endpoint, other, [0], [0])
    assert a.num_writes == 0


def test_sender_failure_is_transfer_error_and_copies_nothing(fake_pair):
    a, b = fake_pair
    _, dst, ls, ld = kv_pair(a, b)
    a.fail_next()
    with pytest.raises(TransferError, match="injected"):
        KVSender(a, ls).send_blocks(b.endpoint, ld, [0, 1], [0, 1])
    assert not dst.any() and a.num_writes == 0
    assert KVSender(a, ls).send_blocks(b.endpoint, ld, [0, 1], [0, 1]) == 3 * 2 * 2 * BB


def test_fetch_pulls_exactly_the_requested_blocks(fake_pair):
    a, b = fake_pair
    src, dst, ls, ld = kv_pair(a, b)
    fetched = KVSender(b, ld).fetch_blocks(a.endpoint, ls, [1, 2, 4], [7, 0, 1])
    assert fetched == 3 * 3 * 2 * BB
    assert (b.num_reads, b.num_bytes_read, b.num_writes, a.num_reads) == (1, fetched, 0, 0)
    expected = torch.zeros_like(dst)
    expected[:, :, [7, 0, 1]] = src[:, :, [1, 2, 4]]
    assert torch.equal(dst, expected)


def test_fetch_some_layers_merges_runs(fake_pair):
    a, b = fake_pair
    src, dst, ls, ld = kv_pair(a, b)
    assert KVSender(b, ld).fetch_blocks(a.endpoint, ls, [0, 1, 2], [3, 4, 5], layers=[2]) == 2 * 3 * BB
    expected = torch.zeros_like(dst)
    expected[2, :, 3:6] = src[2, :, 0:3]
    assert torch.equal(dst, expected)


def test_fetch_with_no_blocks_reads_nothing(fake_pair):
    a, b = fake_pair
    _, _, ls, ld = kv_pair(a, b)
    assert KVSender(b, ld).fetch_blocks(a.endpoint, ls, [], []) == 0
    assert b.num_reads == 0


def test_fetch_rejects_incompatible_layout_before_reading(fake_pair):
    a, b = fake_pair
    _, _, _, ld = kv_pair(a, b)
    other = KVLayout.of_tensor(torch.zeros(3, 2, 6, 4, 2, 16))
    with pytest.raises(ValueError, match="head_dim 8 != 16"):
        KVSender(b, ld).fetch_blocks(a.endpoint, other, [0], [0])
    assert b.num_reads == 0


def test_fetch_failure_is_transfer_error_and_copies_nothing(fake_pair):
    a, b = fake_pair
    src, dst, ls, ld = kv_pair(a, b)
    b.fail_next()
    with pytest.raises(TransferError, match="injected"):
        KVSender(b, ld).fetch_blocks(a.endpoint, ls, [0, 1], [0, 1])
    assert not dst.any() and b.num_reads == 0
    assert KVSender(b, ld).fetch_blocks(a.endpoint, ls, [0, 1], [0, 1]) == 3 * 2 * 2 * BB
    assert torch.equal(dst[:, :, :2], src[:, :, :2]) and not dst[:, :, 2:].any()
