"""The gateway's reports to the planner (services/gateway/load_report.py): requests through
a real gateway and meta-server (tests/gateway_mesh.py) reach the planner's window through
the real ReportRequests RPC, with exact counts; a meta-server that is down costs the report
and nothing else; the gateway reports only when the mesh's planner is on."""
from __future__ import annotations

import asyncio
import socket

import pytest

from common.config import MeshConfig, MetaConfig, PlannerConfig
from protos.pdmesh.v1 import gateway_pb2, meta_pb2, meta_pb2_grpc
from services.gateway.load_report import LoadReporter, report_every_s
from services.gateway.meta_client import MetaClient
from services.meta_server.profile_file import write_profile
from services.meta_server.server import create_server as create_meta_server
from tests.channels import operator_channel
from tests.gateway_mesh import FakeDecode, Mesh
from tests.unit.test_planner import PROFILE


@pytest.fixture
def planner(tmp_path) -> PlannerConfig:
    write_profile(tmp_path / "profile.json", PROFILE)
    return PlannerConfig(enabled=True, interval_s=30.0, profile=str(tmp_path / "profile.json"))


def request(num_prompt_tokens: int, max_tokens: int) -> gateway_pb2.GenerateRequest:
    req = gateway_pb2.GenerateRequest(request_id=f"r{num_prompt_tokens}")
    req.prompt_token_ids.ids.extend(range(3, 3 + num_prompt_tokens))
    req.sampling.max_tokens = max_tokens
    return req


def test_ended_requests_reach_the_planner_through_the_rpc(tiny_model, planner):
    async def main():
        # report_every_s of an hour: the test sends each report itself (flush)
        async with Mesh(tiny_model("llama"), decode=FakeDecode(), planner=planner, report_every_s=3600.0) as mesh:
            reporter, window = mesh.gateway.load_report, mesh.meta.control.planner.window
            assert await reporter.flush() is False          # nothing ended yet: nothing sent
            for n, max_tokens in ((10, 4), (20, 5), (30, 6)):
                msgs = await mesh.generate(request(n, max_tokens))
                assert msgs[-1].finish_reason == "length"
            assert await reporter.flush() is True
            assert (reporter.num_sent, window.num_reports) == (1, 1)
            totals = window.take()
            assert (totals.num_requests, totals.prompt_tokens, totals.output_tokens) == (3, 60, 15)
            assert (totals.num_first_tokens, totals.num_token_gaps) == (3, 12)   # 3 + 4 + 5 gaps
            assert totals.ttft_s_sum > 0 and totals.token_gaps_s_sum > 0
            assert await reporter.flush() is False and window.num_reports == 1   # nothing new: no call

            await mesh.generate(request(8, 2))
            assert await reporter.flush() is True
            mesh.meta.control.planner.tick()
            async with operator_channel(f"127.0.0.1:{mesh.meta_port}") as ch:
                reply = await meta_pb2_grpc.MetaAdminStub(ch).GetPlanner(meta_pb2.GetPlannerRequest())
            i = reply.inputs
            assert (i.num_requests, i.mean_prompt_tokens, i.mean_output_tokens, i.decode_nodes) == (1, 8.0, 2.0, 1)
            assert i.observed_ttft_s > 0 and i.observed_itl_s > 0
    asyncio.run(asyncio.wait_for(main(), 60))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_meta_server_that_is_down_costs_only_the_report(planner):
    async def main():
        port = free_port()
        meta = MetaClient([f"127.0.0.1:{port}"], follow_timeout_s=0.2)
        reporter = LoadReporter(meta, every_s=3600.0, timeout_s=0.5)
        reporter.add(100, 10, 0.5, 0.9)
        reporter.add(50, 0, None, 0.0)               # failed before any token
        assert await reporter.flush() is False
        assert (reporter.num_dropped, reporter.num_sent) == (1, 0)
        server, _ = await create_meta_server(MetaConfig(port=port, planner=planner))
        try:
            await server.control.planner.close()
            reporter.add(7, 1, 0.25, 0.0)
            assert await reporter.flush() is True
            totals = server.control.planner.window.take()   # only what came after the dropped report
            assert (totals.num_requests, totals.prompt_tokens, totals.output_tokens) == (1, 7, 1)
            assert (totals.num_first_tokens, totals.ttft_s_sum, totals.num_token_gaps) == (1, 0.25, 0)
        finally:
            await reporter.close()
            await meta.close()
            await server.stop(0)
            await server.close_extras()
    asyncio.run(asyncio.wait_for(main(), 60))


def test_the_gateway_reports_only_when_the_mesh_plans(tiny_model, planner):
    from services.gateway.server import create_server

    async def gateway_reporter(meta: MetaConfig):
        server, _ = await create_server(MeshConfig(model=str(tiny_model("llama")), meta=meta), port=0)
        try:
            r = server.servicer.load_report
            return None if r is None else r.every_s
        finally:
            await server.stop(0)
            await server.servicer.close()

    assert asyncio.run(gateway_reporter(MetaConfig())) is None
    assert asyncio.run(gateway_reporter(MetaConfig(planner=planner))) == 2.0
    assert (report_every_s(30.0), report_every_s(4.0)) == (2.0, 1.0)
