"""A 1 prefill + 1 decode mesh serving msModelSlim's W8A8C8 layout (W8A8_MIX weights and an
int8 KV cache), written by `pdmesh quantize --scheme w8a8-mix+c8`:

- the prefill node runs the dynamic path and the decode node the static one (each says so
  in its log), and the tokens equal the offline pair that runs exactly that: a dynamic
  engine prefills, its int8 KV blocks are copied into a static engine, which decodes;
- the KV pushed is int8: the prefill node's transfer counter grows by exactly the int8
  size of every prompt (a quarter of float32's).
"""
from __future__ import annotations

import asyncio
import random

import pytest

from common.config import EngineConfig
from common.engine import AsyncEngine, SamplingParams
from common.engine.llm_engine import LLMEngine
from common.model.config import load_model_config
from protos.pdmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.cli import main as pdmesh
from tests.channels import operator_channel
from tests.in_process_prefill import InProcessPrefill
from tests.integration.conftest import ENGINE, engine_stats

MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("w8a8c8") / "w8a8-mix-c8"
    code = pdmesh(["quantize", str(tiny_model("llama")), "--scheme", "w8a8-mix+c8", "--format", "modelslim",
                   "--calib", "gpl-3", "--num-prompts", "8", "--out", str(out)])
    assert code == 0
    return out


@pytest.fixture(scope="module")
def mesh(model, start_mesh):
    return start_mesh(model)


def prompts() -> list[list[int]]:
    rng = random.Random(23)
    return [[rng.randrange(3, 1024) for _ in range(n)] for n in (37, 120, 250, 300)]


def generate(address: str, ids: list[int]) -> tuple[bool, list[int]]:
    req = gateway_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    req.prompt_token_ids.ids.extend(ids)

    async def run():
        async with operator_channel(address) as ch:
            return [m async for m in gateway_pb2_grpc.GatewayStub(ch).Generate(req, timeout=120)]
    msgs = asyncio.run(run())
    return msgs[0].prefill_timing.remote, [t for m in msgs for t in m.token_ids]


def offline_pair(model, ps: list[list[int]]) -> list[list[int]]:
    """Each prompt prefilled by a dynamic-path engine, decoded by a static-path one."""
    def engine(path: str) -> LLMEngine:
        return LLMEngine(EngineConfig(str(model), **ENGINE, w8a8_mix_path=path))
    prefill, decode = engine("dynamic"), engine("static")

    async def collect(engine: AsyncEngine, rid: str, p: list[int]) -> list[int]:
        remote = InProcessPrefill(prefill, decode, rid, p, GREEDY)
        return [t async for out in engine.generate(rid, p, GREEDY, remote=remote) for t in out.new_token_ids]

    async def run():
        engine = AsyncEngine(decode)
        try:
            return [await collect(engine, f"r{i}", p) for i, p in enumerate(ps)]
        finally:
            engine.shutdown()
    return asyncio.run(run())


def offline(model, ps: list[list[int]], path: str) -> list[list[int]]:
    from common.engine import LLM
    with LLM(str(model), **ENGINE, w8a8_mix_path=path) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY)
    return [o.outputs[0].token_ids for o in outs]


def int8_kv_bytes(model, num_tokens: int) -> int:
    cfg = load_model_config(str(model))
    return num_tokens * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 1


def test_prefill_runs_dynamic_decode_runs_static_over_an_int8_push(mesh, model):
    ps = prompts()
    before = engine_stats(mesh.services["prefill-0"].address, "prefill").transfer_bytes_written
    results = [generate(mesh.gateway_address, p) for p in ps]
    pushed = engine_stats(mesh.services["prefill-0"].address, "prefill").transfer_bytes_written - before
    assert all(remote for remote, _ in results)
    assert pushed == sum(int8_kv_bytes(model, len(p)) for p in ps)
    want = offline_pair(model, ps)
    assert [tokens for _, tokens in results] == want
    # the two paths differ on this model: the pair is neither engine alone
    assert want != offline(model, ps, "static") and want != offline(model, ps, "dynamic")
    logs = {name: mesh.services[name].log_path.read_text() for name in ("prefill-0", "decode-0")}
    assert "W8A8_MIX checkpoint: this engine runs its dynamic path" in logs["prefill-0"]
    assert "W8A8_MIX checkpoint: this engine runs its static path" in logs["decode-0"]
    assert "static path" not in logs["prefill-0"] and "dynamic path" not in logs["decode-0"]
    for node, role in (("prefill-0", "prefill"), ("decode-0", "decode")):
        stats = engine_stats(mesh.services[node].address, role)
        assert (stats.used_blocks, stats.quarantined_blocks) == (0, 0)
