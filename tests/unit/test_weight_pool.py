"""A rank's weights as one pool (common/model/weight_pool.py), their identity
(weight_identity.py) and the order a loader tries seeds in: what peer loading rests on."""
from __future__ import annotations

import shutil

import pytest
import torch

from common.config import EngineConfig, TimeoutConfig
from common.model.config import load_model_config
from common.model.registry import build_model
from common.model.weight_identity import weights_identity
from common.model.weight_pool import ALIGN, Manifest, ManifestMismatch, WeightPool
from common.parallel.shard import plan_shard
from kernels import get_backend
from protos.pdmesh.v1 import common_pb2
from services.node.weight_loader import seed_order


def empty_model(model_dir):
    mcfg = load_model_config(model_dir)
    return build_model(mcfg, get_backend("ref", torch.device("cpu")), torch.float32, max_positions=256,
                       shard=plan_shard(mcfg, 1, 0, False))


def loaded_model(model_dir):
    model = empty_model(model_dir)
    model.load_weights(model_dir)
    return model


def test_a_pool_holds_every_parameter_once_and_a_loader_binds_the_same_bytes(tiny_model):
    model_dir = tiny_model("llama")
    seed = loaded_model(model_dir)
    expected = {name: p.detach().clone() for name, p in seed.named_parameters()}
    pool = WeightPool.of_model(seed, bucket_bytes=1 << 16)
    for entry in pool.manifest.tensors:               # views of the pool, not copies
        param = dict(seed.named_parameters())[entry.name]
        assert param.data_ptr() == pool.address + entry.offset and entry.offset % ALIGN == 0
        assert torch.equal(param, expected[entry.name])
    assert pool.manifest.num_buckets > 4 and pool.failed_buckets() == []

    manifest = Manifest.from_proto(pool.manifest.to_proto())
    assert manifest == pool.manifest
    loader = empty_model(model_dir)
    copy = WeightPool.for_manifest(loader, manifest)
    copy.buffer.copy_(pool.buffer)                      # what the one-sided reads do
    assert copy.failed_buckets() == []
    copy.bind(loader)
    for name, p in loader.named_parameters():
        assert torch.equal(p, expected[name]), name


def test_a_flipped_byte_fails_its_bucket_and_names_the_tensor(tiny_model):
    pool = WeightPool.of_model(loaded_model(tiny_model("llama")), bucket_bytes=1 << 16)
    entry = pool.manifest.tensors[3]
    pool.buffer[entry.offset + 5] ^= 0x01
    assert pool.failed_buckets() == [(entry.offset + 5) // (1 << 16)]
    assert entry.name in pool.changed_tensors()


def test_a_manifest_of_another_model_is_refused_naming_the_tensor(tiny_model):
    small = WeightPool.of_model(loaded_model(tiny_model("llama")))
    other = empty_model(tiny_model("llama", hidden_size=96))
    with pytest.raises(ManifestMismatch, match="model.embed_tokens.weight|embed"):
        WeightPool.for_manifest(other, small.manifest)


def test_a_manifest_that_does_not_add_up_is_refused():
    m = Manifest((), total_bytes=100, bucket_bytes=40, bucket_checksums=(b"x", b"y")).to_proto()
    with pytest.raises(ManifestMismatch, match="2 bucket checksums for 100 bytes"):
        Manifest.from_proto(m)
    m.checksum = "md5"
    with pytest.raises(ManifestMismatch, match="checksum 'md5'"):
        Manifest.from_proto(m)


def test_the_identity_changes_with_what_changes_the_bytes_and_only_that(tiny_model, tmp_path):
    model_dir = tmp_path / "m"
    shutil.copytree(tiny_model("llama"), model_dir)
    base = weights_identity(model_dir, "float32", "FloatConfig", "dynamic", 1, False)
    assert len(base) == 32
    assert weights_identity(model_dir, "float32", "FloatConfig", "dynamic", 1, False) == base
    others = {weights_identity(model_dir, "bfloat16", "FloatConfig", "dynamic", 1, False),
              weights_identity(model_dir, "float32", "FloatConfig", "dynamic", 2, False),
              weights_identity(model_dir, "float32", "FloatConfig", "static", 1, False),
              weights_identity(model_dir, "float32", "FloatConfig", "dynamic", 2, True)}
    assert base not in others and len(others) == 4
    config = model_dir / "config.json"
    config.write_text(config.read_text().replace('"rms_norm_eps": 1e-05', '"rms_norm_eps": 1e-06'))
    assert weights_identity(model_dir, "float32", "FloatConfig", "dynamic", 1, False) != base


def test_two_checkpoints_of_one_shape_have_two_identities(tiny_model):
    a, b = tiny_model("llama"), tiny_model("llama", seed=1)     # same config and file sizes, other weights
    assert sorted(f.stat().st_size for f in a.iterdir()) == sorted(f.stat().st_size for f in b.iterdir())
    assert weights_identity(a, "float32", "FloatConfig", "dynamic", 1, False) != \
        weights_identity(b, "float32", "FloatConfig", "dynamic", 1, False)


def test_loaders_spread_over_the_seeds_and_each_keeps_its_order():
    seeds = [common_pb2.NodeInfo(node_id=f"seed-{i}") for i in range(4)]
    firsts = {seed_order(f"node-{k}", seeds)[0].node_id for k in range(32)}
    assert firsts == {s.node_id for s in seeds}
    assert [s.node_id for s in seed_order("node-1", seeds)] == [s.node_id for s in seed_order("node-1", seeds[::-1])]


def test_the_weight_settings_are_checked_with_the_field_named():
    with pytest.raises(ValueError, match="load_format must be one of"):
        EngineConfig(model="m", load_format="s3")
    with pytest.raises(ValueError, match="max_weight_clients must be an integer >= 1"):
        EngineConfig(model="m", max_weight_clients=0)
    with pytest.raises(ValueError, match="weight_bucket_bytes must be an integer >= 4096"):
        EngineConfig(model="m", weight_bucket_bytes=100)
    with pytest.raises(ValueError, match=r"timeouts.weight_lease_s \(60.0\) must be > a third of itself \+ 2 x "
                                         r"timeouts.weight_read_s \+ timeouts.weight_call_s \(65\)"):
        TimeoutConfig(weight_read_s=20.0, weight_lease_s=60.0)
