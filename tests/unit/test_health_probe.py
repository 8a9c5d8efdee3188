"""What a caller gets on a pdmesh port with TLS on, as docs/security.md says, and `pdmesh
health` (the Kubernetes exec probe): an internal port (mTLS) completes no handshake
without a certificate of the mesh CA, so an anonymous caller, a client key and a health
check without --cert all get UNAVAILABLE; with the service's own certificate (or the
operator's) the health check answers SERVING; the gateway's port answers without one.
Real grpc.aio servers of services/node/grpc_util on 127.0.0.1."""
from __future__ import annotations

import asyncio
import contextlib
import io

import grpc
import pytest
from grpc_health.v1 import health_pb2

from protos.pdmesh.v1 import meta_pb2, meta_pb2_grpc
from services.cli import main
from services.node import grpc_util
from services.security.certs import init_certs
from services.security.client_auth import client_channel
from services.security.credentials import MeshCredentials, tls_files

SECRET, API_KEY = b"c" * 32, b"k" * 32


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("probe") / "tls"
    init_certs(folder, ["node-a", "gateway"])
    return folder


async def _serve(creds: MeshCredentials, public: bool = False, serving: bool = True):
    server = grpc_util.new_server(creds, public=public)
    health = grpc_util.add_health_and_reflection(server, [])
    port = grpc_util.bind(server, "127.0.0.1", 0)
    await server.start()
    if serving:
        await grpc_util.mark_serving(health, [])
    else:
        await health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    return server, f"127.0.0.1:{port}"


def _probe(argv: list[str]) -> tuple[int, str]:
    """`pdmesh health ARGV` -> (exit code, its output); run in a thread (asyncio.to_thread)
    so that the servers keep serving on the loop."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["health", *argv])
    return code, out.getvalue().strip()


def test_an_internal_port_under_mtls_answers_health_only_with_a_mesh_certificate(certs):
    async def scenario():
        server, address = await _serve(MeshCredentials(tls=tls_files(str(certs), "node-a"), api_keys=(API_KEY,)))
        try:
            probe = lambda *args: asyncio.to_thread(_probe, [address, "--tls-dir", str(certs), *args])  # noqa: E731
            return [await probe(), await probe("--cert", "node-a"), await probe("--cert", "admin"),
                    await asyncio.to_thread(_probe, [address])]   # plaintext to a TLS port
        finally:
            await server.stop(None)
    no_cert, own, operator, plaintext = asyncio.run(scenario())
    assert no_cert[0] == 1 and no_cert[1].startswith("UNAVAILABLE: ")
    assert no_cert[1].endswith("(no certificate presented: under TLS an internal port needs --cert NAME)")
    assert own == (0, "SERVING") and operator == (0, "SERVING")
    assert plaintext[0] == 1 and plaintext[1].startswith("UNAVAILABLE: ")


def test_anonymous_and_client_key_callers_get_no_handshake_on_an_internal_port(certs):
    """docs/security.md: with TLS a caller without a mesh certificate never reaches the
    auth interceptor on an internal port (UNAVAILABLE), whatever metadata it sends."""
    async def scenario():
        server, address = await _serve(MeshCredentials(tls=tls_files(str(certs), "node-a"), api_keys=(API_KEY,)))
        ca_only = tls_files(str(certs), None)
        codes = []
        try:
            for bearer in (None, API_KEY):
                async with client_channel(address, bearer=bearer, tls=ca_only) as channel:
                    try:
                        await meta_pb2_grpc.MetaServerStub(channel).ListMembers(meta_pb2.ListMembersRequest(),
                                                                               timeout=10)
                        codes.append(grpc.StatusCode.OK)
                    except grpc.aio.AioRpcError as e:
                        codes.append(e.code())
        finally:
            await server.stop(None)
        return codes
    assert asyncio.run(scenario()) == [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE]


def test_the_gateways_port_and_a_plaintext_port_answer_health_without_a_certificate(certs):
    async def scenario():
        gateway, gw_address = await _serve(MeshCredentials(tls=tls_files(str(certs), "gateway")), public=True)
        plain, plain_address = await _serve(MeshCredentials(cluster_secret=SECRET))
        stalled, stalled_address = await _serve(MeshCredentials(cluster_secret=SECRET), serving=False)
        try:
            return [await asyncio.to_thread(_probe, [gw_address, "--tls-dir", str(certs)]),
                    await asyncio.to_thread(_probe, [plain_address]),
                    await asyncio.to_thread(_probe, [stalled_address])]
        finally:
            for s in (gateway, plain, stalled):
                await s.stop(None)
    assert asyncio.run(scenario()) == [(0, "SERVING"), (0, "SERVING"), (1, "NOT_SERVING")]


def test_health_arguments_that_cannot_work_exit_2(certs, capsys):
    assert main(["health", "127.0.0.1:1", "--cert", "node-a"]) == 2
    assert "--cert needs the TLS files" in capsys.readouterr().err
    assert main(["health", "127.0.0.1:1", "--tls-dir", str(certs.parent / "missing")]) == 2
    assert "cannot read" in capsys.readouterr().err
