"""A load ramp through `pdmesh up --autoscale decode=1:2` (a subprocess, as a user runs it):
the planner (every 1.5 s, a hand-written profile) wants a second decode node under long
prompts, the autoscaler starts decode-a1 (weights from the live peer), which serves; under
short prompts the planner wants one again and decode-a1 is drained while requests keep
coming, then stopped. Every request's tokens equal the offline engine's (greedy) and none
fails. Nothing here asserts a duration: the waits only catch a hang.

The profile: decode ITL 0.1 ms up to a mean context of 64 tokens, 1 s from 128 on (one
batch point, so the rate is 1 / ITL whatever the observed correction): a long prompt's
context (200+ tokens) makes one node decode 1 token/s, so any request that ends wants
the upper bound; a short one's (< 64) 10,000 tokens/s: one node."""
from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import queue
import random
import re
import signal

import pytest
import yaml

from common.engine import LLM, SamplingParams
from protos.pdmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, meta_pb2, meta_pb2_grpc
from tests.channels import operator_channel, operator_channel_sync
from tests.integration.conftest import ENGINE, mesh_dict
from services.cli import main
from tests.integration.test_up import READY, START_GUARD_S, Up

HANG_GUARD_S = 180      # a phase that never ends: the autoscaler or the planner is stuck
MAX_TOKENS = 16
PROFILE = {"format": "pdmesh-node-profile/1",
           "prefill": [{"prompt_tokens": 16, "ttft_s": 0.001, "tokens_per_s": 1e6},
                       {"prompt_tokens": 2048, "ttft_s": 0.002, "tokens_per_s": 1e6}],
           "decode": [{"context_tokens": 64, "batch": 1, "itl_s": 0.0001},
                      {"context_tokens": 128, "batch": 1, "itl_s": 1.0}]}
STARTED = re.compile(r"^decode-a1\s+decode\s+started at (\S+) \(pid (\d+)")


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama")


def write_config(tmp_path, model) -> str:
    (tmp_path / "profile.json").write_text(json.dumps(PROFILE))
    planner = {"enabled": True, "interval_s": 1.5, "ttft_slo_ms": 1000, "itl_slo_ms": 100, "min_nodes": 1,
               "max_nodes": 3, "scale_down_after": 2, "cooldown_s": 3, "profile": str(tmp_path / "profile.json")}
    raw = mesh_dict(model, [("prefill", "prefill-0"), ("decode", "decode-0")], planner=planner)
    path = tmp_path / "mesh.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


class Lines:
    """The `pdmesh up` lines read so far, taken from its reader thread without blocking."""

    def __init__(self, up: Up):
        self.up = up

    def take(self) -> list[str]:
        while True:
            try:
                line = self.up._queue.get_nowait()
            except queue.Empty:
                return self.up.lines
            if line is not None:
                self.up.lines.append(line)

    def seen(self, pattern: str) -> bool:
        return any(re.match(pattern, line) for line in self.take())


def routed_to(meta: str, node_id: str) -> int:
    with operator_channel_sync(meta) as ch:
        stats = meta_pb2_grpc.MetaAdminStub(ch).GetStats(meta_pb2.GetStatsRequest(), timeout=5)
    return next((n.num_routed for n in stats.nodes if n.node_id == node_id), 0)


def node_states(meta: str) -> list[tuple[str, str]]:
    with operator_channel_sync(meta) as ch:
        nodes = meta_pb2_grpc.MetaAdminStub(ch).ListNodes(meta_pb2.ListNodesRequest(), timeout=5).nodes
    return sorted((n.info.node_id, n.state) for n in nodes)


def pdmesh(*args: str) -> str:
    """`pdmesh ARGS` in this process, as the operator (the admin token of the environment);
    its stdout."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(list(args)) == 0, out.getvalue()
    return out.getvalue()


async def generate(gateway: str, prompt: list[int]) -> tuple[list[int], str]:
    req = gateway_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    req.prompt_token_ids.ids.extend(prompt)
    async with operator_channel(gateway) as ch:
        msgs = [m async for m in gateway_pb2_grpc.GatewayStub(ch).Generate(req, timeout=60)]
    return [t for m in msgs for t in m.token_ids], msgs[-1].finish_reason


async def load(gateway: str, prompt_lens: tuple[int, int], num_clients: int, until, done: list, rng) -> None:
    """num_clients clients each send a prompt after the other's end, until until() holds;
    every (prompt, tokens, finish_reason) goes to done; an error ends the test."""
    async def client():
        while not until():
            prompt = [rng.randrange(3, 1024) for _ in range(rng.randrange(*prompt_lens))]
            tokens, finish = await generate(gateway, prompt)
            done.append((prompt, tokens, finish))
    clients = [asyncio.ensure_future(client()) for _ in range(num_clients)]
    try:
        await asyncio.wait_for(asyncio.gather(*clients), HANG_GUARD_S)
    finally:
        for c in clients:
            c.cancel()


def test_a_load_ramp_grows_the_decode_pool_and_drains_it_back(tmp_path, model):
    up = Up(write_config(tmp_path, model), tmp_path / "logs", "--autoscale", "decode=1:2", "--no-core-plan",
            env={"PDMESH_STATE_DIR": str(tmp_path / "state")})
    lines = Lines(up)
    rng = random.Random(31)
    long_done: list = []
    short_done: list = []
    try:
        gateway = up.wait_for(READY, START_GUARD_S)[1]
        meta = json.loads((tmp_path / "state" / "mesh.json").read_text())["meta"]
        up.wait_for(re.compile(r"^autoscale\s+decode 1\.\.2 nodes, following the planner \(every 1\.5s\)$"), 30)

        # long prompts until decode-a1 is up and has served some of them
        asyncio.run(load(gateway, (200, 300), 3, lambda: lines.seen(STARTED.pattern)
                         and routed_to(meta, "decode-a1") >= 2, long_done, rng))
        served = routed_to(meta, "decode-a1")
        # short prompts until the planner wanted one node again and decode-a1 drained and stopped
        asyncio.run(load(gateway, (5, 30), 2, lambda: lines.seen(r"^decode-a1\s+stopped$"), short_done, rng))

        out = "\n".join(lines.take())
        assert re.search(r"^autoscale\s+decode\s+1 -> 2 nodes \(planner decision \d+: ", out, re.M), out
        assert re.search(r"^autoscale\s+decode\s+the planner wants 3 nodes; held within 1\.\.2$", out, re.M), out
        assert re.search(r"^autoscale\s+decode\s+2 -> 1 nodes \(planner decision \d+: ", out, re.M), out
        order = [r"^decode-a1\s+decode\s+starting \(autoscale\)$", STARTED.pattern,
                 r"^decode-a1\s+decode\s+draining \(autoscale\)", r"^decode-a1\s+decode\s+drained in [\d.]+s; stopping$",
                 r"^decode-a1\s+stopped$"]
        at = [next(i for i, line in enumerate(up.lines) if re.match(p, line)) for p in order]
        assert at == sorted(at), out
        assert not re.search(r"^decode-a2", out, re.M), "never above the upper bound"
        assert not re.search(r"still draining|did not start|could not|killed|exited", out, re.M), out
        assert re.search(r"weights: .* from seed \S+", (tmp_path / "logs" / "decode-a1.log").read_text()), \
            "decode-a1 loaded its weights from a live peer"
        pid = int(next(m for line in up.lines if (m := STARTED.match(line)))[2])
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
        assert node_states(meta) == [("decode-0", "up"), ("prefill-0", "up")]

        # `pdmesh drain` (a pool pod's preStop on Kubernetes) on the idle prefill node, then undone
        prefill = next(m[1] for line in up.lines if (m := re.match(r"^prefill-0\s+prefill\s+healthy at (\S+)", line)))
        drained = pdmesh("drain", "prefill-0", "--meta", meta, "--wait", prefill, "--timeout", "60")
        assert re.fullmatch(rf"prefill-0: drained at {meta}\nprefill-0: idle after [\d.]+s \(nothing running, "
                            r"waiting or moving KV\)\n", drained), drained
        assert node_states(meta) == [("decode-0", "up"), ("prefill-0", "draining")]
        assert pdmesh("drain", "prefill-0", "--meta", meta, "--undo") == f"prefill-0: undrained at {meta}\n"
        assert node_states(meta) == [("decode-0", "up"), ("prefill-0", "up")]
        assert routed_to(meta, "decode-a1") == 0, "forgotten once stopped (RemoveNode)"
        print(f"{len(long_done)} long and {len(short_done)} short requests; decode-a1 had served {served} "
              "when the long prompts stopped", *(line for line in up.lines if re.match(r"autoscale|decode-a", line)),
              sep="\n")

        llm = LLM(str(model), **ENGINE)
        done = long_done + short_done
        outs = llm.generate([{"prompt_token_ids": p} for p, _, _ in done],
                            SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
        for i, ((prompt, tokens, finish), want) in enumerate(zip(done, outs)):
            assert (tokens, finish) == (want.outputs[0].token_ids, "length"), f"request {i} ({len(prompt)} tokens)"

        up.proc.send_signal(signal.SIGTERM)
        assert up.finish(timeout_s=60) == 0, "\n".join(up.lines)
    finally:
        if up.proc.poll() is None:   # a failed test: stop the mesh as a user would, then make sure
            up.proc.send_signal(signal.SIGTERM)
            try:
                up.proc.wait(timeout=60)
            except Exception:   # noqa: BLE001 (killed below)
                pass
        up.kill()
