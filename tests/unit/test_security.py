"""Who may call what (services/security), over real gRPC on 127.0.0.1: a meta-server with
the session's cluster secret and admin token, a fake node's membership, and the rules of
each kind of RPC; credentials loading; the registry's fixed TTL and node_id ownership."""
from __future__ import annotations

import asyncio
import os
import stat

import grpc
import pytest

from common.config import MetaConfig, SecurityConfig
from protos.pdmesh.v1 import common_pb2, meta_pb2, meta_pb2_grpc
from services.meta_server.server import create_server
from services.security.client_auth import client_channel, mesh_channel
from services.security.credentials import MeshCredentials, MissingCredentialsError, load_credentials
from services.security.mesh_secrets import make_missing_secrets
from services.security.server_auth import SECRET_METADATA
from tests.channels import operator_channel

TTL = 30.0
CLIENT_KEY = "client-key-" + "k" * 20


def node(node_id: str = "decode-0", address: str = "127.0.0.1:1") -> common_pb2.NodeInfo:
    return common_pb2.NodeInfo(node_id=node_id, role="decode", address=address, model_id="m")


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def _with_meta(body, api_keys=()):
    creds = load_credentials()
    if api_keys:
        creds = MeshCredentials(creds.cluster_secret, creds.admin_token, tuple(k.encode() for k in api_keys))
    server, port = await create_server(MetaConfig(port=0, ttl_seconds=TTL), credentials=creds)
    try:
        await body(f"127.0.0.1:{port}", server)
    finally:
        await server.stop(0)
        await server.close_extras()


async def _code(call) -> grpc.StatusCode:
    try:
        await call
    except grpc.aio.AioRpcError as e:
        assert "127.0.0.1" not in (e.details() or "") and "Error" not in (e.details() or "")
        return e.code()
    return grpc.StatusCode.OK


def test_each_kind_of_rpc_admits_only_its_credential():
    async def body(address, server):
        register = meta_pb2.RegisterRequest(node=node(), instance_id="real")
        callers = {
            "anonymous": client_channel(address),
            "wrong secret": client_channel(address),
            "client key": client_channel(address, bearer=CLIENT_KEY),
            "admin token": client_channel(address, bearer=os.environ["PDMESH_ADMIN_TOKEN"]),
            "mesh": mesh_channel(address),
        }
        callers["wrong secret"]._extra = ((SECRET_METADATA, "x" * 32),)
        U, P, OK = grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.OK
        expected_internal = {"anonymous": U, "wrong secret": U, "client key": P, "admin token": P, "mesh": OK}
        expected_admin = {"anonymous": U, "wrong secret": U, "client key": P, "admin token": OK, "mesh": P}
        for who, ch in callers.items():
            meta, admin = meta_pb2_grpc.MetaServerStub(ch), meta_pb2_grpc.MetaAdminStub(ch)
            assert await _code(meta.Register(register)) == expected_internal[who], who
            assert await _code(meta.ListMembers(meta_pb2.ListMembersRequest())) == expected_internal[who], who
            assert await _code(admin.SetPolicy(meta_pb2.SetPolicyRequest(policy="round_robin"))) == \
                expected_admin[who], who
            from grpc_health.v1 import health_pb2, health_pb2_grpc
            reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
            assert reply.status == health_pb2.HealthCheckResponse.SERVING     # probes stay open
        members = server.control.registry.members()
        assert [(m.node_id, m.instance_id) for m in members] == [("decode-0", "real")]
        assert server.control.policy() == "round_robin"
        for ch in callers.values():
            await ch.close()
    run(_with_meta(body, api_keys=[CLIENT_KEY]))


def test_a_refused_call_never_parses_its_request():
    """Garbage bytes from an anonymous caller are refused as unauthenticated, not parsed."""
    async def body(address, server):
        async with client_channel(address) as ch:
            call = ch.unary_unary("/pdmesh.v1.MetaServer/Register", request_serializer=None,
                                  response_deserializer=None)(b"\xff\xff\xff garbage")
            assert await _code(call) == grpc.StatusCode.UNAUTHENTICATED
    run(_with_meta(body))


def test_registration_ttl_is_the_registry_s_and_a_live_node_id_stays_its_owner_s():
    async def body(address, server):
        async with operator_channel(address) as ch:
            meta = meta_pb2_grpc.MetaServerStub(ch)
            reply = await meta.Register(meta_pb2.RegisterRequest(node=node(), ttl_seconds=1e9, instance_id="real"))
            assert reply.ttl_seconds == TTL and server.control.registry.get("decode-0").ttl_s == TTL
            impostor = meta_pb2.RegisterRequest(node=node(address="127.0.0.1:666"), instance_id="impostor")
            assert await _code(meta.Register(impostor)) == grpc.StatusCode.PERMISSION_DENIED
            assert await _code(meta.Deregister(meta_pb2.DeregisterRequest(
                node_id="decode-0", instance_id="impostor"))) == grpc.StatusCode.PERMISSION_DENIED
            assert await _code(meta.Heartbeat(meta_pb2.HeartbeatRequest(
                node_id="decode-0", instance_id="impostor"))) == grpc.StatusCode.NOT_FOUND
            assert server.control.registry.get("decode-0").info.address == "127.0.0.1:1"
            for bad in (node(node_id="x" * 129), node(node_id="a b"), node(node_id=""),
                        node(address="h" * 300), common_pb2.NodeInfo(node_id="n", role="root", address="a:1")):
                assert await _code(meta.Register(meta_pb2.RegisterRequest(node=bad))) == \
                    grpc.StatusCode.INVALID_ARGUMENT
            assert await _code(meta.Register(meta_pb2.RegisterRequest(node=node("d1"), instance_id="i" * 300))) == \
                grpc.StatusCode.INVALID_ARGUMENT
            assert [m.node_id for m in server.control.registry.members()] == ["decode-0"]
    run(_with_meta(body))


def test_a_service_without_the_mesh_identity_does_not_start(monkeypatch):
    from services.node.grpc_util import new_server
    monkeypatch.delenv("PDMESH_CLUSTER_SECRET")
    with pytest.raises(MissingCredentialsError, match="cluster secret"):
        load_credentials()
    with pytest.raises(MissingCredentialsError, match="cluster secret"):
        run(create_server(MetaConfig(port=0), credentials=load_credentials(require_identity=False)))
    with pytest.raises(MissingCredentialsError, match="cluster secret"):
        new_server(MeshCredentials(admin_token=b"t" * 20))


def test_credentials_come_from_files_or_the_environment_and_never_show(tmp_path, monkeypatch):
    secret = tmp_path / "secret"
    secret.write_text("s" * 40 + "\n")
    creds = load_credentials(SecurityConfig(cluster_secret_file=str(secret)))
    assert creds.cluster_secret == b"s" * 40
    assert "s" * 40 not in repr(creds) and "cluster_secret" in repr(creds)
    short = tmp_path / "short"
    short.write_text("abc")
    with pytest.raises(MissingCredentialsError, match="at least 16 bytes"):
        load_credentials(SecurityConfig(cluster_secret_file=str(short)))
    monkeypatch.setenv("PDMESH_ADMIN_TOKEN", "has a space in it, long enough")
    with pytest.raises(MissingCredentialsError, match="printable ASCII"):
        load_credentials()
    with pytest.raises(MissingCredentialsError, match="cannot read"):
        load_credentials(SecurityConfig(cluster_secret_file=str(tmp_path / "missing")))


def test_pdmesh_up_makes_only_the_missing_secrets_private(tmp_path):
    from common.config import mesh_config_from_dict
    mesh = mesh_config_from_dict({"model": "m"})
    env = make_missing_secrets(mesh, tmp_path / "creds", environ={"PDMESH_CLUSTER_SECRET": "x" * 20})
    assert sorted(env) == ["PDMESH_ADMIN_TOKEN_FILE", "PDMESH_API_KEYS_FILE"]
    assert stat.S_IMODE((tmp_path / "creds").stat().st_mode) == 0o700
    for path in env.values():
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and len(open(path).read().strip()) >= 32
    assert make_missing_secrets(mesh, tmp_path / "again", environ={
        "PDMESH_CLUSTER_SECRET": "x" * 20, **env}) == {}
