"""What a NodeInfo may hold before the meta-server lists it (services/meta_server/node_info_check.py)."""
from __future__ import annotations

import re

import pytest

from protos.pdmesh.v1 import common_pb2
from services.meta_server.node_info_check import node_info_error


def info(**fields) -> common_pb2.NodeInfo:
    return common_pb2.NodeInfo(node_id="n0", role="decode", address="127.0.0.1:1", **fields)


LAYOUT = common_pb2.KVLayout(dtype="float32", num_layers=2, num_blocks=8, block_size=16, num_kv_heads=2,
                             head_dim=4, base_address=4096, strides=[1024, 512, 256, 16, 8, 4])


def rank(port: int, **layout) -> common_pb2.KVRank:
    moved = common_pb2.KVLayout()
    moved.CopyFrom(LAYOUT)
    for name, value in layout.items():
        setattr(moved, name, value)
    return common_pb2.KVRank(transfer_endpoint=f"127.0.0.1:{port}", layout=moved)


def test_a_plain_node_and_a_tp_node_with_one_entry_per_rank_pass():
    assert node_info_error(info()) == ""
    ranks = [rank(1), rank(2, base_address=1 << 20)]
    assert node_info_error(info(tensor_parallel_size=2, kv_ranks=ranks, transfer_endpoint="127.0.0.1:1",
                                kv_layout=LAYOUT)) == ""
    assert node_info_error(info(tensor_parallel_size=2)) == ""
    # every rank's engine has listeners of its own: 8 addresses a rank
    assert node_info_error(info(tensor_parallel_size=2, kv_ranks=ranks, transfer_endpoint="127.0.0.1:1",
                                kv_layout=LAYOUT, transfer_listen_addresses=["127.0.0.1:7"] * 16)) == ""


@pytest.mark.parametrize("ranks,error", [
    ([rank(9), rank(2)], r"node.kv_ranks\[0\] must repeat node.transfer_endpoint and node.kv_layout"),
    ([rank(1, base_address=8), rank(2)], r"node.kv_ranks\[0\] must repeat"),
    ([rank(1), rank(2, num_kv_heads=4)], r"node.kv_ranks\[1\].layout must match node.kv_layout in kind, dtype, "
                                         r"scales_id, num_layers, num_blocks, block_size, num_kv_heads, head_dim"),
    ([rank(1), rank(2, scales_id="c8:0123456789abcdef")], r"node.kv_ranks\[1\].layout must match node.kv_layout"),
    ([rank(1), rank(2, kind="latent", num_kv_heads=1)], r"node.kv_ranks\[1\].layout must match node.kv_layout in kind"),
    ([rank(1), rank(2, kind="latent")], r"node.kv_ranks\[1\].layout.num_kv_heads must be 1 for kind latent"),
    ([rank(1), rank(2, kind="latent_split", num_kv_heads=1)],
     r"node.kv_ranks\[1\].layout.rope_dim must be > 0 for kind latent_split and 0 otherwise"),
    ([rank(1), rank(2, rope_dim=64)], r"node.kv_ranks\[1\].layout.rope_dim must be > 0 for kind latent_split"),
    ([rank(1), rank(2, rope_dim=-1)], r"node.kv_ranks\[1\].layout.rope_dim must be > 0 for kind latent_split"),
    ([rank(1, kind="mla"), rank(2, kind="mla")],
     r"node.kv_ranks\[0\].layout.kind must be one of kv, latent, latent_split"),
])
def test_rank_entries_must_agree_with_what_rank_0_published(ranks, error):
    msg = info(tensor_parallel_size=2, kv_ranks=ranks, transfer_endpoint="127.0.0.1:1", kv_layout=LAYOUT)
    assert re.search(error, node_info_error(msg)), node_info_error(msg)


@pytest.mark.parametrize("fields,error", [
    ({"tensor_parallel_size": -1}, r"node.tensor_parallel_size must be in \[0, 64\]"),
    ({"tensor_parallel_size": 1000}, r"node.tensor_parallel_size must be in \[0, 64\]"),
    ({"tensor_parallel_size": 2, "kv_ranks": [common_pb2.KVRank()] * 3}, "one entry per tensor-parallel rank"),
    ({"kv_ranks": [common_pb2.KVRank(transfer_endpoint="x" * 300)]}, "transfer_endpoint must be at most 256"),
    ({"kv_ranks": [common_pb2.KVRank(layout=common_pb2.KVLayout(strides=[1] * 9))]},
     r"node.kv_ranks\[0\].layout: dtype at most 32 characters, at most 8 strides"),
    ({"kv_ranks": [common_pb2.KVRank(listen_addresses=["127.0.0.1:1"] * 9)]},
     r"node.kv_ranks\[\].listen_addresses: at most 8 of at most 256 characters each"),
    ({"transfer_listen_addresses": ["127.0.0.1:1"] * 9}, "node.transfer_listen_addresses: at most 8 of"),
    ({"role": "boss"}, "node.role must be one of prefill, decode, both"),
])
def test_bad_fields_are_named(fields, error):
    msg = info()
    for name, value in fields.items():
        if name in ("kv_ranks", "transfer_listen_addresses"):
            getattr(msg, name).extend(value)
        else:
            setattr(msg, name, value)
    assert re.search(error, node_info_error(msg)), node_info_error(msg)
