"""The planner wired into the meta-server (services/meta_server/planner_loop.py), over real
gRPC: recorded gateway reports (ReportRequests), routes and node heartbeats in, one
interval ended by hand (tick; the loop's own timer is stopped first), and the exact
counts out of GetPlanner, `pdmesh admin planner` and /metrics; the report RPC's
authorization and validation; the planner off; a bad profile."""
from __future__ import annotations

import asyncio
import json
import os

import grpc
import pytest
from prometheus_client import generate_latest

from common.config import MetaConfig, PlannerConfig
from protos.pdmesh.v1 import common_pb2, meta_pb2, meta_pb2_grpc
from services.meta_server.metrics import meta_registry
from services.meta_server.profile_file import ProfileError, write_profile
from services.meta_server.server import create_server
from services.security.client_auth import client_channel
from tests.channels import operator_channel
from tests.unit.test_planner import PROFILE

# 300 requests in a 30 s interval (10/s) from two gateways: 960-token prompts, 128 tokens
# out, TTFT 5.44 s, ITL 0.09 s (token-weighted: 127 gaps a request)
REPORTS = (
    dict(num_requests=100, prompt_tokens=96000, output_tokens=12800, num_first_tokens=100, ttft_s_sum=544.0,
         num_token_gaps=12700, token_gaps_s_sum=1143.0),
    dict(num_requests=200, prompt_tokens=192000, output_tokens=25600, num_first_tokens=200, ttft_s_sum=1088.0,
         num_token_gaps=25400, token_gaps_s_sum=2286.0),
)
NODES = (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"), ("d1", "decode"), ("d2", "decode"),
         ("d3", "decode"))
WAITING = {"p0": 25, "p1": 17}          # prompts queued at the prefill nodes: 42
HASHES = [bytes([i]) * 8 for i in range(60)]     # a 960-token prompt's 60 blocks of 16


def node(node_id: str, role: str) -> common_pb2.NodeInfo:
    return common_pb2.NodeInfo(node_id=node_id, role=role, address=f"127.0.0.1:{NODES.index((node_id, role)) + 1}",
                               model_id="m", kv_layout=common_pb2.KVLayout(block_size=16, num_blocks=64),
                               load=common_pb2.NodeLoad(free_blocks=64, total_blocks=64))


def load(node_id: str) -> common_pb2.NodeLoad:
    """The heartbeat's load: prefill nodes queue WAITING prompts, decode nodes use 48 of 64 blocks."""
    return common_pb2.NodeLoad(waiting=WAITING.get(node_id, 0), free_blocks=64 if node_id in WAITING else 16,
                               total_blocks=64)


def planner_cfg(profile_path, **over) -> PlannerConfig:
    return PlannerConfig(**{"enabled": True, "interval_s": 30.0, "ttft_slo_ms": 1000.0, "itl_slo_ms": 100.0,
                            "min_nodes": 1, "max_nodes": 8, "scale_down_after": 3, "cooldown_s": 120.0,
                            "profile": str(profile_path), **over})


def run_with_meta(test, planner: PlannerConfig | None, policy: str = "cache_aware"):
    """test(meta, admin, server, address) on a fresh meta-server with NODES registered."""
    async def main():
        cfg = MetaConfig(port=0, ttl_seconds=60.0, policy=policy, **({"planner": planner} if planner else {}))
        server, port = await create_server(cfg)
        if server.control.planner is not None:
            await server.control.planner.close()     # the test ends the intervals (tick)
        address = f"127.0.0.1:{port}"
        try:
            async with operator_channel(address) as ch:
                meta, admin = meta_pb2_grpc.MetaServerStub(ch), meta_pb2_grpc.MetaAdminStub(ch)
                for node_id, role in NODES:
                    await meta.Register(meta_pb2.RegisterRequest(node=node(node_id, role)))
                await test(meta, admin, server, address)
        finally:
            await server.stop(0)
            await server.close_extras()
    asyncio.run(asyncio.wait_for(main(), 60))


@pytest.fixture
def profile_path(tmp_path):
    path = tmp_path / "profile.json"
    write_profile(path, PROFILE, {"model_id": "m"})
    return path


async def record_interval(meta) -> None:
    """What one interval brings: two routes of the same 960-token prompt (the second hits
    all of it on p0: a 50% hit rate), the gateways' reports, the nodes' heartbeats."""
    for _ in range(2):
        reply = await meta.Route(meta_pb2.RouteRequest(model_id="m", num_prompt_tokens=960, block_hashes=HASHES))
        assert reply.prefill.node_id == "p0"
    for report in REPORTS:
        assert (await meta.ReportRequests(meta_pb2.ReportRequestsRequest(**report))).accepted
    for node_id, _ in NODES:
        await meta.Heartbeat(meta_pb2.HeartbeatRequest(node_id=node_id, load=load(node_id)))


def test_recorded_reports_and_heartbeats_give_the_expected_counts(profile_path, capsys):
    async def test(meta, admin, server, address):
        await record_interval(meta)
        assert (await admin.GetPlanner(meta_pb2.GetPlannerRequest())).num_decisions == 0   # none before a tick
        server.control.planner.tick()
        reply = await admin.GetPlanner(meta_pb2.GetPlannerRequest())
        i = reply.inputs
        assert (reply.enabled, reply.num_decisions, reply.profile) == (True, 1, str(profile_path))
        assert (i.num_requests, i.request_rate, i.mean_prompt_tokens, i.mean_output_tokens) == (300, 10.0, 960.0, 128.0)
        # 42 queued prompts x (960 tokens x (1 - 0.5)); 48 of 64 blocks used on each decode node
        assert (i.prefix_hit_rate, i.prefill_queue_tokens, i.decode_kv_usage) == (0.5, 20160, 0.75)
        assert (i.observed_ttft_s, round(i.observed_itl_s, 12), i.prefill_nodes, i.decode_nodes) == (5.44, 0.09, 2, 4)
        # prefill: the profile predicts 0.2 s + 20160 / (4000 x 2) = 2.72 s, 5.44 s was seen:
        # correction 2 -> 2000 tokens/s, 0.4 s a prompt; 4800 tokens/s -> 3; the queue
        # drained within 0.6 s -> ceil(16.8) = 17, capped at max_nodes 8 (grows at once).
        # decode: ITL 0.09 s seen at batch 28.8 a node -> 4 (tests/unit/test_planner.py)
        roles = [(r.role, r.current_nodes, r.wanted_nodes, r.desired_nodes) for r in reply.roles]
        assert roles == [("prefill", 2, 17, 8), ("decode", 4, 4, 4)]
        assert reply.roles[0].reason.startswith(
            "4800 prompt tokens/s (isl 480 after a 50% hit rate) at 2000 tokens/s a node (correction 2.00): 3; "
            "20160 queued tokens drained within 600 ms: 17")
        assert reply.roles[1].reason == ("1280 output tokens/s at 320 tokens/s a node for ITL 100 ms at context "
                                         "1024 (correction 0.98): 4")

        text = generate_latest(meta_registry(server.control)).decode()
        for line in ('pdmesh:planner_desired_nodes{role="prefill"} 8.0',
                     'pdmesh:planner_desired_nodes{role="decode"} 4.0',
                     'pdmesh:planner_wanted_nodes{role="prefill"} 17.0',
                     'pdmesh:planner_current_nodes{role="decode"} 4.0',
                     "pdmesh:planner_decisions_total 1.0", "pdmesh:planner_request_rate 10.0",
                     "pdmesh:planner_mean_prompt_tokens 960.0", "pdmesh:planner_mean_output_tokens 128.0",
                     "pdmesh:planner_prefix_hit_rate 0.5", "pdmesh:planner_prefill_queue_tokens 20160.0",
                     "pdmesh:planner_decode_kv_usage 0.75", "pdmesh:planner_observed_ttft_seconds 5.44"):
            assert line in text.splitlines(), line

        from services.cli import main
        assert await asyncio.to_thread(main, ["admin", "planner", "--meta", address, "--json"]) == 0
        shown = json.loads(capsys.readouterr().out)
        assert [(r["role"], r["desired_nodes"]) for r in shown["roles"]] == [("prefill", 8), ("decode", 4)]
        assert shown["inputs"]["prefill_queue_tokens"] == 20160 and shown["inputs"]["num_requests"] == 300
        assert await asyncio.to_thread(main, ["admin", "planner", "--meta", address]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines[0] == (f"planner: on, every 30s for TTFT <= 1000 ms, ITL <= 100 ms; 1..8 nodes a role; "
                            f"profile {profile_path}")
        assert lines[2] == "  requests   300 (10.00/s), mean prompt 960 tokens, mean output 128 tokens"
        assert lines[3] == "  caches     50.0% of prompt tokens hit; prefill queue 20160 tokens; decode KV use 75.0%"
        assert lines[4] == "  observed   TTFT 5440.0 ms, ITL 90.0 ms"
        assert lines[5].split() == ["ROLE", "NOW", "WANTED", "DESIRED", "WHY"]
        assert lines[6].split()[:4] == ["prefill", "2", "17", "8"] and lines[7].split()[:4] == ["decode", "4", "4", "4"]

        # the next interval brought nothing: the window started empty, the counts are kept
        server.control.planner.tick()
        reply = await admin.GetPlanner(meta_pb2.GetPlannerRequest())
        assert (reply.num_decisions, reply.inputs.num_requests, reply.inputs.prefix_hit_rate) == (2, 0, 0.0)
        assert reply.inputs.observed_ttft_s == 0.0 and reply.inputs.observed_itl_s == 0.0
        assert [(r.current_nodes, r.wanted_nodes, r.desired_nodes) for r in reply.roles] == [(2, 0, 2), (4, 0, 4)]
        assert reply.roles[1].reason.endswith("; kept 4: 1 of 3 intervals below")
        text = generate_latest(meta_registry(server.control)).decode()
        assert not any(line.startswith("pdmesh:planner_observed_ttft_seconds ") for line in text.splitlines())
    run_with_meta(test, planner_cfg(profile_path))


def test_report_calls_need_the_mesh_identity_and_valid_sums(profile_path):
    async def test(meta, admin, server, address):
        report = meta_pb2.ReportRequestsRequest(**REPORTS[0])
        for bearer, code in ((None, grpc.StatusCode.UNAUTHENTICATED),
                             (os.environ["PDMESH_ADMIN_TOKEN"], grpc.StatusCode.PERMISSION_DENIED)):
            async with client_channel(address, bearer=bearer) as ch:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await meta_pb2_grpc.MetaServerStub(ch).ReportRequests(report)
                assert err.value.code() == code
        for bad, message in (({"num_requests": -1}, "num_requests must be in [0, 1099511627776], got -1"),
                             ({"ttft_s_sum": float("nan")}, "ttft_s_sum must be a finite number of seconds"),
                             ({"num_first_tokens": 101}, "num_first_tokens (101) must be <= num_requests (100)"),
                             ({"num_token_gaps": 12801}, "num_token_gaps (12801) must be <= output_tokens (12800)")):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await meta.ReportRequests(meta_pb2.ReportRequestsRequest(**{**REPORTS[0], **bad}))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in err.value.details()
        assert server.control.planner.window.num_reports == 0          # nothing refused was counted
        assert (await meta.ReportRequests(report)).accepted
        assert server.control.planner.window.num_reports == 1
    run_with_meta(test, planner_cfg(profile_path))


def test_the_planner_off_drops_reports_and_says_so(capsys):
    async def test(meta, admin, server, address):
        assert server.control.planner is None
        assert not (await meta.ReportRequests(meta_pb2.ReportRequestsRequest(**REPORTS[0]))).accepted
        assert (await admin.GetPlanner(meta_pb2.GetPlannerRequest())) == meta_pb2.GetPlannerResponse(enabled=False)
        assert "planner_desired_nodes" not in generate_latest(meta_registry(server.control)).decode()
        from services.cli import main
        assert await asyncio.to_thread(main, ["admin", "planner", "--meta", address]) == 0
        assert capsys.readouterr().out.strip() == "planner: off (meta_server.planner.enabled is false)"
    run_with_meta(test, None)


def test_before_the_first_decision_the_cli_says_when_it_comes(profile_path, capsys):
    async def test(meta, admin, server, address):
        from services.cli import main
        assert await asyncio.to_thread(main, ["admin", "planner", "--meta", address, "--json"]) == 0
        assert json.loads(capsys.readouterr().out) == {
            "enabled": True, "interval_s": 3600.0, "ttft_slo_ms": 1000.0, "itl_slo_ms": 100.0, "min_nodes": 1,
            "max_nodes": 8, "profile": str(profile_path), "num_decisions": 0}
        assert await asyncio.to_thread(main, ["admin", "planner", "--meta", address]) == 0
        assert capsys.readouterr().out.splitlines()[1] == \
            "no decision yet (the first comes 3600s after the meta-server started)"
    run_with_meta(test, planner_cfg(profile_path, interval_s=3600.0))


def test_a_missing_or_bad_profile_stops_the_meta_server_before_it_serves(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "pdmesh-node-profile/1", "prefill": [
        {"prompt_tokens": 128, "ttft_s": 0.01, "tokens_per_s": 0}], "decode": [
        {"context_tokens": 128, "batch": 1, "itl_s": 0.002}]}))
    for path, message in ((tmp_path / "none.json", "cannot read it"),
                          (bad, "prefill[0].tokens_per_s must be a number > 0, got 0")):
        with pytest.raises(ProfileError) as err:
            asyncio.run(create_server(MetaConfig(port=0, planner=planner_cfg(path))))
        assert str(err.value).startswith(f"node profile {path}: ") and message in str(err.value)
