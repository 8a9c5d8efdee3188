"""plan_head_slice_writes' exact writes (a tensor-parallel prefill rank writing its heads into
part of a decode rank's heads), its refusals, and two prefill ranks assembling one decode
rank's cache through KVSender.send_blocks(head_offset=...) over the fake engine."""
from __future__ import annotations

import pytest
import torch

from common.kv_layout import KVLayout
from common.transfer import KVSender, plan_block_writes
from common.transfer.fake import FakeTransfer
from common.transfer.kv_writes import plan_head_slice_writes

# Tiny layout: block_size 4, head_dim 2, float32. A token slot holds heads x 2 x 4 bytes:
# 16 bytes with 2 heads (a prefill rank), 32 bytes with 4 heads (the decode rank).
SRC_BASE, DST_BASE = 0x10000, 0x80000


def layout(num_kv_heads: int, num_blocks: int, base: int, dtype: str = "float32", head_dim: int = 2,
           block_size: int = 4, num_layers: int = 2) -> KVLayout:
    """A packed cache [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim] at base."""
    item = {"float32": 4, "float16": 2}[dtype]
    slot = num_kv_heads * head_dim * item
    block = block_size * slot
    return KVLayout(dtype=dtype, num_layers=num_layers, num_blocks=num_blocks, block_size=block_size,
                    num_kv_heads=num_kv_heads, head_dim=head_dim, base_address=base,
                    strides=(2 * num_blocks * block, num_blocks * block, block, slot, head_dim * item, item))


SRC = layout(2, num_blocks=3, base=SRC_BASE)  # slot 16, block 64, K/V stride 192, layer stride 384
DST = layout(4, num_blocks=5, base=DST_BASE)  # slot 32, block 128, K/V stride 640, layer stride 1280


def test_one_block_one_layer_exact_writes():
    # layer 1, src block 2 -> dst block 3, heads [2, 4): 8 bytes per head, so +16 in each dst slot
    src_k, dst_k = SRC_BASE + 384 + 2 * 64, DST_BASE + 1280 + 3 * 128 + 16
    src_v, dst_v = src_k + 192, dst_k + 640
    assert plan_head_slice_writes(SRC, DST, 2, [2], [3], layers=[1]) == [
        (src_k, dst_k, 16), (src_k + 16, dst_k + 32, 16), (src_k + 32, dst_k + 64, 16), (src_k + 48, dst_k + 96, 16),
        (src_v, dst_v, 16), (src_v + 16, dst_v + 32, 16), (src_v + 32, dst_v + 64, 16), (src_v + 48, dst_v + 96, 16),
    ]


def expected_writes(head_offset, src_ids, dst_ids, layers=(0, 1), last_block_tokens=None):
    """By hand from the strides above: order layer, K before V, block, token slot."""
    out = []
    for layer in layers:
        for kv in (0, 1):
            for i, (s, d) in enumerate(zip(src_ids, dst_ids)):
                slots = last_block_tokens if i == len(src_ids) - 1 and last_block_tokens else 4
                for t in range(slots):
                    out.append((SRC_BASE + layer * 384 + kv * 192 + s * 64 + t * 16,
                                DST_BASE + layer * 1280 + kv * 640 + d * 128 + t * 32 + head_offset * 8, 16))
    return out


@pytest.mark.parametrize("head_offset", [0, 1, 2])
def test_several_blocks_order_and_offsets(head_offset):
    got = plan_head_slice_writes(SRC, DST, head_offset, [0, 1, 2], [4, 0, 1])
    assert len(got) == 2 * 2 * 3 * 4
    assert got == expected_writes(head_offset, [0, 1, 2], [4, 0, 1])


@pytest.mark.parametrize("tokens", [1, 3, 4])
def test_partial_last_block_writes_only_its_first_slots(tokens):
    got = plan_head_slice_writes(SRC, DST, 2, [1, 2], [2, 3], last_block_tokens=tokens)
    assert got == expected_writes(2, [1, 2], [2, 3], last_block_tokens=tokens)
    assert len(got) == 2 * 2 * (4 + tokens)


def test_same_heads_at_offset_zero_is_plan_block_writes():
    dst = layout(2, num_blocks=5, base=DST_BASE)
    for kw in ({}, {"layers": [1]}, {"last_block_tokens": 3}):
        got = plan_head_slice_writes(SRC, dst, 0, [0, 1, 2], [2, 3, 0], **kw)
        assert got == plan_block_writes(SRC, dst, [0, 1, 2], [2, 3, 0], **kw)
    # runs of blocks stay one write each: layer 0 K, blocks 0-1 -> 2-3
    assert plan_head_slice_writes(SRC, dst, 0, [0, 1], [2, 3], layers=[0])[0] == (SRC_BASE, DST_BASE + 2 * 64, 128)


@pytest.mark.parametrize("src, dst, head_offset, match", [
    (SRC, DST, 3, r"heads \[3, 5\) do not fit the destination's 4 KV heads"),
    (SRC, DST, -1, r"heads \[-1, 1\) do not fit"),
    (SRC, layout(2, 5, DST_BASE), 1, r"heads \[1, 3\) do not fit the destination's 2"),
    (layout(4, 3, SRC_BASE), SRC, 0, r"heads \[0, 4\) do not fit the destination's 2"),
    (SRC, layout(4, 5, DST_BASE, head_dim=4), 0, "head_dim 2 != 4"),
    (SRC, layout(4, 5, DST_BASE, dtype="float16"), 0, "dtype 'float32' != 'float16'"),
    (SRC, layout(4, 5, DST_BASE, block_size=8), 0, "block_size 4 != 8"),
    (SRC, layout(4, 5, DST_BASE, num_layers=3), 0, "num_layers 2 != 3"),
])
def test_incompatible_layouts_and_heads_that_do_not_fit(src, dst, head_offset, match):
    with pytest.raises(ValueError, match=match):
        plan_head_slice_writes(src, dst, head_offset, [0], [0])


@pytest.mark.parametrize("src_ids, dst_ids, kw, match", [
    ([3], [0], {}, r"src_block_ids \[3\] outside \[0, 3\)"),
    ([-1], [0], {}, r"src_block_ids \[-1\] outside"),
    ([0], [5], {}, r"dst_block_ids \[5\] outside \[0, 5\)"),
    ([0, 1], [2, 2], {}, "dst_block_ids has duplicates"),
    ([0, 1], [2], {}, "2 source block ids but 1 destination ids"),
    ([0], [0], {"layers": [2]}, r"layers \[2\] outside \[0, 2\)"),
    ([0], [0], {"last_block_tokens": 0}, r"last_block_tokens must be in \[1, 4\], got 0"),
    ([0], [0], {"last_block_tokens": 5}, r"last_block_tokens must be in \[1, 4\], got 5"),
])
def test_bad_ids_layers_and_last_block_tokens(src_ids, dst_ids, kw, match):
    with pytest.raises(ValueError, match=match):
        plan_head_slice_writes(SRC, DST, 2, src_ids, dst_ids, **kw)


@pytest.mark.parametrize("last_block_tokens", [None, 3])
def test_two_prefill_ranks_assemble_one_decode_rank(last_block_tokens):
    """Prefill ranks with heads [0, 2) and [2, 4) push blocks 0-2 into decode blocks 4, 0, 2 of
    a 4-head cache: those blocks become the two sources concatenated along the heads (past
    last_block_tokens in the last one: untouched), and blocks 1 and 3 stay as they were."""
    torch.manual_seed(0)
    ranks = [torch.randn(2, 2, 3, 4, 2, 2) for _ in range(2)]
    dst = torch.randn(2, 2, 5, 4, 4, 2)
    before = dst.clone()
    receiver = FakeTransfer()
    dst_layout = KVLayout.of_tensor(dst)
    receiver.register(dst_layout.base_address, dst_layout.span_bytes)
    src_ids, dst_ids = [0, 1, 2], [4, 0, 2]
    engines = []
    for rank, kv in enumerate(ranks):
        engine = FakeTransfer()
        engines.append(engine)
        local = KVLayout.of_tensor(kv)
        engine.register(local.base_address, local.span_bytes)
        sent = KVSender(engine, local).send_blocks(receiver.endpoint, dst_layout, src_ids, dst_ids,
                                                   last_block_tokens=last_block_tokens, head_offset=2 * rank)
        tokens = 2 * 4 + (last_block_tokens or 4)
        assert sent == 2 * 2 * tokens * 2 * 2 * 4  # layers x K/V x slots x heads x head_dim x 4 bytes

    want = before.clone()
    full = torch.cat(ranks, dim=4)
    want[:, :, dst_ids[:-1]] = full[:, :, src_ids[:-1]]
    tail = last_block_tokens or 4
    want[:, :, dst_ids[-1], :tail] = full[:, :, src_ids[-1], :tail]
    assert torch.equal(dst, want)
    assert torch.equal(dst[:, :, [1, 3]], before[:, :, [1, 3]])
    for engine in engines + [receiver]:
        engine.close()
