"""Weights from a live peer (issue 31 item 1): real processes (meta-server, gateway, decode
nodes), Mooncake over TCP. decode-0 loads from the disk and becomes a weight seed; nodes
started beside it read its weights one-sided, bucket by bucket (64 KiB buckets here, so
a tiny model has dozens), check every bucket's checksum, and serve exactly the tokens of
a disk-loaded engine. A corrupted bucket, a seed killed -9 mid-read and a node of another
identity each end the way the issue asks: another seed, the disk, or a clear refusal.
The tests run in order on one mesh: the corrupting seed decode-2 of the third is the second
seed the fourth's loader falls through."""
from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import grpc
import pytest
import torch

from common.engine import LLM, SamplingParams
from common.model.weight_pool import Manifest
from common.transfer.base import TransferError
from common.transfer.mooncake import MooncakeTransfer
from protos.pdmesh.v1 import common_pb2, meta_pb2, meta_pb2_grpc, weights_pb2, weights_pb2_grpc
from services.node.weight_loader import seed_order
from tests.channels import operator_channel_sync
from tests.integration.conftest import ENGINE, engine_stats
from tests.integration.test_mesh import assert_no_blocks_in_use, request, stream

BUCKET = 1 << 16
PROMPTS = [[(7919 * i + 31 * k) % 1000 + 3 for i in range(20 + 9 * k)] for k in range(4)]
TIMEOUTS = {"weight_read_s": 2.0, "weight_call_s": 2.0, "weight_lease_s": 20.0}   # a stall costs 2 x 2 s
FAULTS = {"PDMESH_FAULT_INJECTION": "1"}
HANG_GUARD_S = 60.0


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def mesh(start_mesh, model):
    return start_mesh(model, nodes=[("decode", "decode-0")],
                      top={"engine": {**ENGINE, "weight_bucket_bytes": BUCKET}, "timeouts": TIMEOUTS})


@pytest.fixture(scope="module")
def disk_tokens(model):
    llm = LLM(str(model), **ENGINE)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def checkpoint_bytes(model_dir: Path) -> int:
    from safetensors import safe_open
    total = 0
    for path in model_dir.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                t = f.get_slice(name)
                n = 1
                for d in t.get_shape():
                    n *= d
                total += n * {"F32": 4, "BF16": 2, "F16": 2}[t.get_dtype()]
    return total


def stats(mesh, node_id: str):
    return engine_stats(mesh.services[node_id].address, "decode")


def log_of(mesh, node_id: str) -> str:
    return Path(mesh.services[node_id].log_path).read_text(errors="replace")


def members(mesh) -> dict[str, common_pb2.NodeInfo]:
    with operator_channel_sync(mesh.meta_address) as ch:
        reply = meta_pb2_grpc.MetaServerStub(ch).ListMembers(meta_pb2.ListMembersRequest(), timeout=5)
    return {n.node_id: n for n in reply.nodes}


def generate_all(mesh) -> list[list[int]]:
    out = []
    for p in PROMPTS:
        tokens, _, msgs = asyncio.run(stream(mesh.gateway_address, request(p, max_tokens=10)))
        assert msgs[-1].finish_reason == "length"
        out.append(tokens)
    return out


def only(mesh, node_id: str):
    """Drain every other decode node while the block runs (the gateway routes to node_id)."""
    import contextlib

    @contextlib.contextmanager
    def drained():
        others = [n for n in members(mesh) if n != node_id]
        with mesh.admin_channel() as ch:
            admin = meta_pb2_grpc.MetaAdminStub(ch)
            for n in others:
                admin.DrainNode(meta_pb2.DrainNodeRequest(node_id=n), timeout=5)
            try:
                yield
            finally:
                for n in others:
                    admin.UndrainNode(meta_pb2.UndrainNodeRequest(node_id=n), timeout=5)
    return drained()


def loader_id_trying_first(seed: str, seeds: list[str], prefix: str) -> str:
    """A node id whose seed_order puts `seed` first among seeds."""
    infos = [common_pb2.NodeInfo(node_id=s) for s in seeds]
    for k in range(1000):
        candidate = f"{prefix}-{k}"
        if seed_order(candidate, infos)[0].node_id == seed:
            return candidate
    raise AssertionError("no such id")


def test_a_node_started_beside_a_seed_reads_its_weights_and_serves_the_same_tokens(mesh, model, disk_tokens):
    seed = stats(mesh, "decode-0")
    assert (seed.weights_source, seed.weight_leases_granted) == ("disk", 0)
    mesh.add_node({"role": "decode", "node_id": "decode-1", "engine": {"load_format": "peer"}})
    s = stats(mesh, "decode-1")
    assert (s.weights_source, s.weights_seed) == ("peer", "decode-0")
    assert s.weights_bytes == seed.weights_bytes == checkpoint_bytes(model)
    # every byte of the seed's pool came over the transfer engine (the node reads no KV)
    assert s.transfer_bytes_read == members(mesh)["decode-0"].weight_seed.total_bytes >= s.weights_bytes
    assert stats(mesh, "decode-0").weight_leases_granted == 1
    assert "from seed decode-0" in log_of(mesh, "decode-1")
    info = members(mesh)["decode-1"].weight_seed      # and it serves them in turn
    assert info.identity == members(mesh)["decode-0"].weight_seed.identity
    with only(mesh, "decode-1"):
        assert generate_all(mesh) == disk_tokens
    assert_no_blocks_in_use(mesh)
    mesh.kill("decode-1")


def test_a_seed_exposes_its_weights_only_while_a_lease_is_held(mesh):
    info = members(mesh)["decode-0"]
    reader = MooncakeTransfer()
    try:
        with operator_channel_sync(info.address) as ch:
            stub = weights_pb2_grpc.WeightSeedStub(ch)
            wrong = weights_pb2.OpenWeightsRequest(identity="0" * 32, tensor_parallel_size=1)
            with pytest.raises(grpc.RpcError) as refused:
                stub.OpenWeights(wrong, timeout=5)
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            def ask(loader):
                return weights_pb2.OpenWeightsRequest(identity=info.weight_seed.identity, tensor_parallel_size=1,
                                                      loader_node_id=loader)
            leases = [stub.OpenWeights(ask(f"test-{k}"), timeout=5) for k in range(info.weight_seed.max_clients)]
            with pytest.raises(grpc.RpcError) as full:
                stub.OpenWeights(ask("one-too-many"), timeout=5)
            assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            rank = leases[0].ranks[0]
            manifest = Manifest.from_proto(rank.manifest)
            assert manifest.bucket_bytes == BUCKET and len(manifest.buckets()) > 4
            local = torch.zeros(256, dtype=torch.uint8)
            address = local.data_ptr()
            reader.register(address, 256)
            assert reader.read(rank.transfer_endpoint, [(address, rank.base_address, 256)], timeout_s=5) == 256
            for lease in leases:
                stub.CloseWeights(weights_pb2.WeightLease(lease_id=lease.lease_id), timeout=5)
            with pytest.raises(TransferError):     # unregistered with the last lease
                reader.read(rank.transfer_endpoint, [(address, rank.base_address, 256)], timeout_s=5)
    finally:
        reader.close()


def test_a_corrupted_bucket_is_detected_and_read_again_from_another_seed(mesh):
    # decode-2 becomes a seed that corrupts bucket 3 whenever it serves
    mesh.add_node({"role": "decode", "node_id": "decode-2"},
                  env={**FAULTS, "PDMESH_FAULT_CORRUPT_WEIGHT_BUCKET": "3"})
    loader = loader_id_trying_first("decode-2", ["decode-0", "decode-2"], "loader")
    mesh.add_node({"role": "decode", "node_id": loader, "engine": {"load_format": "peer"}})
    s = stats(mesh, loader)
    assert (s.weights_source, s.weights_seed) == ("peer", "decode-0")
    assert "decode-2: checksum mismatch in bucket(s) [3]" in log_of(mesh, loader)
    mesh.kill(loader)


def test_a_seed_killed_mid_read_sends_the_node_on_to_the_next_seed_then_the_disk(mesh, disk_tokens, tmp_path):
    gate = tmp_path / "go"
    loader = loader_id_trying_first("decode-0", ["decode-0", "decode-2"], "late")
    started = mesh.add_node({"role": "decode", "node_id": loader}, wait=False,
                            env={**FAULTS, "PDMESH_FAULT_WEIGHT_READ_GATE": str(gate)})
    deadline = time.monotonic() + HANG_GUARD_S
    while "waiting for" not in log_of(mesh, loader):     # bucket 0 read from decode-0, then held
        assert time.monotonic() < deadline, "the loader never reached its gate"
        time.sleep(0.05)
    mesh.kill("decode-0")
    gate.write_text("go")
    started()
    s = stats(mesh, loader)
    assert s.weights_source == "disk"
    text = log_of(mesh, loader)
    assert "decode-0: mooncake read" in text and "decode-2: checksum mismatch" in text
    with only(mesh, loader):
        assert generate_all(mesh) == disk_tokens


def test_a_seed_that_stalls_mid_read_is_given_up_on_within_the_read_timeout(mesh, tmp_path):
    stalled = next(n for n in members(mesh) if n.startswith("late-"))     # the last test's node, a seed now
    gate = tmp_path / "go"
    loader = loader_id_trying_first(stalled, [stalled, "decode-2"], "patient")
    started = mesh.add_node({"role": "decode", "node_id": loader}, wait=False,
                            env={**FAULTS, "PDMESH_FAULT_WEIGHT_READ_GATE": str(gate)})
    deadline = time.monotonic() + HANG_GUARD_S
    while "waiting for" not in log_of(mesh, loader):
        assert time.monotonic() < deadline, "the loader never reached its gate"
        time.sleep(0.05)
    pid = mesh.services[stalled].process.pid
    os.killpg(pid, signal.SIGSTOP)
    try:
        gate.write_text("go")
        started()
    finally:
        os.killpg(pid, signal.SIGCONT)
    assert stats(mesh, loader).weights_source == "disk"
    text = log_of(mesh, loader)
    assert f"{stalled}: mooncake read with" in text and "timed out" in text
    assert "stays allocated and registered, unused" in text      # the read gave up with bytes in flight
    mesh.kill(loader)


def test_a_node_of_another_identity_with_load_format_peer_refuses_to_start(mesh):
    with pytest.raises(RuntimeError):
        mesh.add_node({"role": "decode", "node_id": "decode-bf16",
                       "engine": {"load_format": "peer", "dtype": "bfloat16"}}, timeout_s=60)
    assert "engine.load_format is peer but no weight seed could serve decode-bf16: no live weight seed of this " \
           "model identity" in log_of(mesh, "decode-bf16")


def test_tensor_parallel_nodes_read_rank_by_rank_from_a_tensor_parallel_seed(start_mesh, model):
    mesh = start_mesh(model, nodes=[("decode", "tp-seed")], top={
        "engine": {**ENGINE, "tensor_parallel_size": 2, "weight_bucket_bytes": BUCKET}, "timeouts": TIMEOUTS})
    mesh.add_node({"role": "decode", "node_id": "tp-loader", "engine": {"load_format": "peer"}})
    seed, s = stats(mesh, "tp-seed"), stats(mesh, "tp-loader")
    assert (seed.weights_source, s.weights_source, s.weights_seed) == ("disk", "peer", "tp-seed")
    assert s.weights_bytes == seed.weights_bytes and seed.weight_leases_granted == 2   # a lease per rank
    info = members(mesh)
    assert info["tp-loader"].weight_seed == info["tp-seed"].weight_seed     # it serves them in turn
    assert info["tp-seed"].weight_seed.tensor_parallel_size == 2
    assert "tensor-parallel rank 1: weights from peer seed tp-seed" in log_of(mesh, "tp-loader")
    with only(mesh, "tp-seed"):
        from_disk = generate_all(mesh)
    with only(mesh, "tp-loader"):
        assert generate_all(mesh) == from_disk
