"""The attacks of issue 13, replayed against a mesh with the default `pdmesh up` security
(the launcher makes a fresh cluster secret, admin token and API key for the mesh; the
session's test secrets are withheld from it), and against the same mesh with TLS on
(`pdmesh certs init`; mTLS between services). The attacker is a process on the same host
with the public protos: anonymous, or holding a valid client API key (with TLS: it trusts
the mesh CA but has no certificate of it). Every attack must fail with its exact status
code, and the victim's greedy output must stay exactly what it was before the attacks,
and be the same on both meshes."""
from __future__ import annotations

import asyncio
import http.client
import json
import os
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

from protos.pdmesh.v1 import (common_pb2, engine_pb2, engine_pb2_grpc, gateway_pb2, gateway_pb2_grpc,
                              kv_store_pb2, kv_store_pb2_grpc, meta_pb2, meta_pb2_grpc)
from services.security.client_auth import client_channel
from services.security.credentials import tls_files
from services.node.grpc_util import free_port
from tests.integration.conftest import launch, mesh_dict

ROOT = Path(__file__).resolve().parents[2]
U, P = grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED
NODES = (("prefill", "prefill-0"), ("decode", "decode-0"))
VICTIM_PROMPT = list(range(5, 5 + 40))     # two full blocks: its KV goes to the kv-store too
# The mesh gets none of the session's secrets: it must make its own, as `pdmesh up` does.
WITHHELD = {"PDMESH_CLUSTER_SECRET": "", "PDMESH_ADMIN_TOKEN": ""}
HANG_GUARD_S = 60     # only catches a hang: a loaded machine may take many seconds


def _mesh(tmp_path_factory, model, tls_dir: str = ""):
    raw = mesh_dict(model, NODES, top={"kv_store": {"port": 0, "capacity_mb": 32},
                                       "gateway": {"port": 0, "http_port": free_port()}})
    if tls_dir:
        raw["security"] = {"tls_dir": tls_dir}
    return launch(tmp_path_factory.mktemp("secure-mesh"), raw, env=dict(WITHHELD))


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def plain_mesh(tmp_path_factory, model):
    m = _mesh(tmp_path_factory, model)
    m.tls = False
    yield m
    m.stop()


@pytest.fixture(scope="module")
def tls_mesh(tmp_path_factory, model):
    from services.security.certs import init_certs
    certs = tmp_path_factory.mktemp("certs")
    init_certs(certs, ["meta-server", "gateway", "kv-store", "prefill-0", "decode-0"], force=True)
    m = _mesh(tmp_path_factory, model, tls_dir=str(certs))
    m.tls, m.certs = True, certs
    yield m
    m.stop()


@pytest.fixture(scope="module", params=["plaintext", "tls"])
def mesh(request):
    return request.getfixturevalue("plain_mesh" if request.param == "plaintext" else "tls_mesh")


def refused(mesh, who: str, port: str = "internal") -> grpc.StatusCode:
    """What an attacker gets: without TLS UNAUTHENTICATED (anonymous) or PERMISSION_DENIED
    (a client key on a call that is not the public API); with TLS no handshake at all on
    every port but the gateway's (UNAVAILABLE), whatever metadata it sends."""
    if mesh.tls and port != "gateway":
        return grpc.StatusCode.UNAVAILABLE
    return U if who == "anonymous" else P


def call_code(fn, *args, **kwargs) -> grpc.StatusCode:
    """The status of a blocking call; the details must not leak addresses or class names."""
    try:
        result = fn(*args, timeout=HANG_GUARD_S, **kwargs)
        if hasattr(result, "__iter__") and not hasattr(result, "ByteSize"):
            list(result)
    except grpc.RpcError as e:
        details = e.details() or ""
        if e.code() == grpc.StatusCode.UNAVAILABLE and details.startswith("failed to connect"):
            return e.code()      # this client's own grpc text: no handshake happened
        assert "127.0.0.1" not in details and "ipv4" not in details and "Error" not in details, details
        return e.code()
    return grpc.StatusCode.OK


def generate(mesh, prompt=VICTIM_PROMPT, max_tokens: int = 12) -> list[int]:
    async def run() -> list[int]:
        async with mesh.gateway_channel() as ch:
            req = gateway_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(
                max_tokens=max_tokens, ignore_eos=True))
            req.prompt_token_ids.ids.extend(prompt)
            tokens = []
            async for msg in gateway_pb2_grpc.GatewayStub(ch).Generate(req, timeout=60):
                tokens.extend(msg.token_ids)
            return tokens
    return asyncio.run(run())


@pytest.fixture(scope="module")
def victim(plain_mesh) -> list[int]:
    tokens = generate(plain_mesh)
    assert len(tokens) == 12
    return tokens


def channels(mesh, address: str) -> dict:
    tls = tls_files(str(mesh.certs), None) if mesh.tls else None   # the CA only: no certificate
    return {"anonymous": client_channel(address, tls=tls, sync=True),
            "client key": client_channel(address, bearer=mesh.api_key(), tls=tls, sync=True)}


def test_the_mesh_made_its_own_secrets_and_the_services_hold_them_in_files(mesh, victim):
    folder = mesh.log_dir / "credentials"
    made = ["admin_token", "api_keys"] if mesh.tls else ["admin_token", "api_keys", "cluster_secret"]
    assert sorted(p.name for p in folder.iterdir()) == made     # with TLS the certificates are the identity
    assert all(oct(p.stat().st_mode & 0o777) == "0o600" for p in folder.iterdir())
    secrets = [(folder / name).read_text().strip() for name in made]
    assert os.environ["PDMESH_CLUSTER_SECRET"] not in secrets and os.environ["PDMESH_ADMIN_TOKEN"] not in secrets
    for svc in mesh.services.values():
        environ = Path(f"/proc/{svc.process.pid}/environ").read_bytes().split(b"\0")
        assert f"PDMESH_ADMIN_TOKEN_FILE={folder / 'admin_token'}".encode() in environ
        if mesh.tls:
            assert not any(v.startswith(b"PDMESH_CLUSTER_SECRET") and not v.endswith(b"=") for v in environ)
        else:
            assert f"PDMESH_CLUSTER_SECRET_FILE={folder / 'cluster_secret'}".encode() in environ
        argv = Path(f"/proc/{svc.process.pid}/cmdline").read_bytes()
        log = svc.log_path.read_text()
        for secret in secrets:
            assert secret.encode() not in argv and secret not in log, svc.name
    assert generate(mesh) == victim      # the same tokens over TLS as in plaintext


def test_an_impostor_cannot_join_and_members_are_not_listed(mesh, victim):
    impostor = common_pb2.NodeInfo(node_id="decode-0", role="decode", address="127.0.0.1:1", model_id="tiny")
    for who, ch in channels(mesh, mesh.meta_address).items():
        stub = meta_pb2_grpc.MetaServerStub(ch)
        want = refused(mesh, who)
        assert call_code(stub.Register, meta_pb2.RegisterRequest(node=impostor, ttl_seconds=1e9)) == want
        assert call_code(stub.ListMembers, meta_pb2.ListMembersRequest()) == want
        assert call_code(stub.Route, meta_pb2.RouteRequest(model_id="tiny", num_prompt_tokens=4)) == want
        assert call_code(stub.Deregister, meta_pb2.DeregisterRequest(node_id="decode-0")) == want
    with mesh.admin_channel() as ch:
        nodes = {n.info.node_id: n for n in meta_pb2_grpc.MetaAdminStub(ch).ListNodes(
            meta_pb2.ListNodesRequest(), timeout=5).nodes}
    assert nodes["decode-0"].info.address == mesh.services["decode-0"].address
    assert nodes["decode-0"].state == "up"
    assert generate(mesh) == victim


def test_the_data_plane_rpcs_refuse_outsiders(mesh, victim):
    dest = engine_pb2.KVDestination(node_id="decode-0", transfer_endpoint="127.0.0.1:1",
                                    block_ids=list(range(8)))
    for who, ch in channels(mesh, mesh.services["prefill-0"].address).items():
        want = refused(mesh, who)
        req = engine_pb2.PrefillRequest(request_id="evil", prompt_token_ids=VICTIM_PROMPT, destination=dest,
                                        sampling=common_pb2.SamplingParams(max_tokens=1))
        assert call_code(engine_pb2_grpc.PrefillStub(ch).Prefill, req) == want
    for who, ch in channels(mesh, mesh.services["kv-store"].address).items():
        want = refused(mesh, who)
        stub = kv_store_pb2_grpc.KVStoreStub(ch)
        for i in range(5):   # squatting key spaces
            assert call_code(stub.ReservePut, kv_store_pb2.ReservePutRequest(space=kv_store_pb2.KeySpace(model_id=f"bogus-{i}"))) == want
        assert call_code(stub.PinGet, kv_store_pb2.PinGetRequest(space=kv_store_pb2.KeySpace(model_id="tiny"))) == want
        assert call_code(stub.Stats, kv_store_pb2.StatsRequest()) == want
    assert generate(mesh) == victim
    with client_channel(mesh.services["kv-store"].address, bearer=admin_token(mesh), tls=mesh.client_tls(),
                        sync=True) as ch:
        deadline = time.monotonic() + HANG_GUARD_S   # the prefill node puts its blocks after its reply
        while kv_store_pb2_grpc.KVStoreStub(ch).Stats(kv_store_pb2.StatsRequest(), timeout=5).blocks_used < 2:
            assert time.monotonic() < deadline, "the real model's blocks never reached the kv-store"
            time.sleep(0.1)


def admin_token(mesh) -> str:
    return (mesh.log_dir / "credentials" / "admin_token").read_text().strip()


def test_the_admin_api_needs_the_admin_token(mesh, victim):
    for who, ch in channels(mesh, mesh.meta_address).items():
        want = refused(mesh, who, "admin")
        stub = meta_pb2_grpc.MetaAdminStub(ch)
        assert call_code(stub.DrainNode, meta_pb2.DrainNodeRequest(node_id="decode-0")) == want
        for _ in range(5):
            assert call_code(stub.RemoveNode, meta_pb2.RemoveNodeRequest(node_id="decode-0")) == want
        assert call_code(stub.SetPolicy, meta_pb2.SetPolicyRequest(policy="round_robin")) == want
        assert call_code(stub.ListNodes, meta_pb2.ListNodesRequest()) == want
    with mesh.admin_channel() as ch:
        assert meta_pb2_grpc.MetaAdminStub(ch).GetPolicy(meta_pb2.GetPolicyRequest(), timeout=5).policy == "least_load"
    assert generate(mesh) == victim


def test_the_decode_node_serves_only_the_mesh(mesh, victim):
    req = engine_pb2.DecodeRequest(request_id="bypass", prompt_token_ids=VICTIM_PROMPT,
                                   sampling=common_pb2.SamplingParams(max_tokens=4))
    for who, ch in channels(mesh, mesh.services["decode-0"].address).items():
        assert call_code(engine_pb2_grpc.DecodeStub(ch).Generate, req) == refused(mesh, who)


def test_a_public_client_needs_a_key(mesh, victim):
    for bearer, want in ((None, U), ("not-the-key-" + "x" * 20, U)):
        with client_channel(mesh.gateway_address, bearer=bearer, tls=mesh.client_tls(None), sync=True) as ch:
            req = gateway_pb2.GenerateRequest(prompt="hello", sampling=common_pb2.SamplingParams(max_tokens=2))
            assert call_code(gateway_pb2_grpc.GatewayStub(ch).Generate, req) == want
            assert call_code(gateway_pb2_grpc.GatewayStub(ch).ListModels, gateway_pb2.ListModelsRequest()) == want


def test_a_key_holder_s_oversized_or_malformed_requests_are_refused_naming_the_field(mesh, victim):
    """The input attacks, by a client with a valid key: each refused before any work with
    INVALID_ARGUMENT naming the field (and the limit), nothing internal in the text. Each
    "X is N ...; the limit is limits.Y = Z" text is the gateway's bounds check's
    (services/gateway/request_limits.py), which runs on the parsed message before the
    prompt is tokenized, as the sampling check does: the text proves where it was refused
    (the seconds are only printed)."""
    def sampling(**kw):
        return common_pb2.SamplingParams(max_tokens=4, **kw)
    cases = [
        (gateway_pb2.GenerateRequest(prompt="x" * (10 << 20), sampling=sampling()),
         "prompt is 10485760 bytes; the limit is limits.max_prompt_bytes = 1048576"),
        (gateway_pb2.GenerateRequest(prompt="hi", sampling=sampling(stop_token_ids=[3] * 10 ** 6)),
         "sampling.stop_token_ids has 1000000 ids; the limit is limits.max_stop_token_ids = 256"),
        (gateway_pb2.GenerateRequest(prompt="hi", sampling=sampling(stop=["s"] * 10 ** 4)),
         "sampling.stop has more than 16 strings; the limit is limits.max_stop_strings = 16"),
        (gateway_pb2.GenerateRequest(prompt="hi", sampling=sampling(stop=["s" * (1 << 20)])),
         "sampling.stop[0] is 1048576 bytes; the limit is limits.max_stop_string_bytes = 256"),
        (gateway_pb2.GenerateRequest(prompt="hi", request_id="r" * (10 << 20), sampling=sampling()),
         "request_id is 10485760 bytes; the limit is limits.max_request_id_bytes = 256"),
        (gateway_pb2.GenerateRequest(prompt="hi", sampling=sampling(temperature=float("inf"))), "temperature"),
    ]
    with client_channel(mesh.gateway_address, bearer=mesh.api_key(), tls=mesh.client_tls(None), sync=True) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        for req, message in cases:
            start = time.monotonic()
            try:
                list(stub.Generate(req, timeout=HANG_GUARD_S))
                raise AssertionError(f"accepted: {message}")
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and message in e.details(), e.details()
                assert "127.0.0.1" not in e.details() and "Error" not in e.details()
            print(f"refused in {time.monotonic() - start:.2f} s: {message}")
        with pytest.raises(grpc.RpcError) as exc:
            stub.Tokenize(gateway_pb2.TokenizeRequest(text="x" * (10 << 20)), timeout=30)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert exc.value.details() == "text is 10485760 bytes; the limit is limits.max_prompt_bytes = 1048576"
        raw = gateway_pb2.GenerateRequest(prompt="MARK", sampling=sampling()).SerializeToString()
        call = ch.unary_stream("/pdmesh.v1.Gateway/Generate", request_serializer=None,
                               response_deserializer=gateway_pb2.GenerateResponse.FromString)
        with pytest.raises(grpc.RpcError) as exc:
            list(call(raw.replace(b"MARK", b"\xffARK"), timeout=30))
        assert (exc.value.code(), exc.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT,
                                                           "prompt is not valid UTF-8")
    assert generate(mesh) == victim


def test_the_cli_works_with_the_generated_credentials_and_refuses_a_wrong_key(mesh, tmp_path):
    env = {**os.environ, **WITHHELD, "PYTHONPATH": str(ROOT)}
    if mesh.tls:
        env["PDMESH_TLS_DIR"] = str(mesh.certs)
    creds = mesh.log_dir / "credentials"
    cli = [sys.executable, "-m", "services.cli"]
    out = subprocess.run([*cli, "generate", "--gateway", mesh.gateway_address, "--max-tokens", "4",
                          "--api-key-file", str(creds / "api_keys"), "hello"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "finish_reason=length" in out.stdout
    wrong = tmp_path / "wrong"
    wrong.write_text("wrong-key-" + "w" * 30 + "\n")
    out = subprocess.run([*cli, "generate", "--gateway", mesh.gateway_address, "--api-key-file", str(wrong), "hi"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "UNAUTHENTICATED" in out.stderr
    out = subprocess.run([*cli, "admin", "nodes", "--json", "--meta", mesh.meta_address,
                          "--token-file", str(creds / "admin_token")], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and '"decode-0"' in out.stdout, out.stderr
    for token, code in ((wrong, "UNAUTHENTICATED"), (creds / "api_keys", "PERMISSION_DENIED")):
        out = subprocess.run([*cli, "admin", "drain", "decode-0", "--meta", mesh.meta_address,
                              "--token-file", str(token)], env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 1 and code in out.stderr, out.stderr


# ---- what only TLS adds ---------------------------------------------------------


def _http_get(url: str, key: str | None, context=None) -> tuple[int, dict]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=HANG_GUARD_S, context=context) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def test_the_http_api_needs_a_key_and_with_tls_speaks_https_only(mesh, victim):
    """The OpenAI API on the same mesh: the API key is required, and with TLS the port
    speaks HTTPS with the gateway's certificate (a client trusting the mesh CA gets the
    victim's tokens; a plain-HTTP client, or one that does not trust the CA, gets nothing)."""
    import openai
    url = mesh.http_address
    assert url.startswith("https://" if mesh.tls else "http://"), url
    ca = str(mesh.certs / "ca.crt") if mesh.tls else None
    context = ssl.create_default_context(cafile=ca) if mesh.tls else None
    for key in (None, "not-the-key-" + "x" * 20):
        status, answer = _http_get(url + "/v1/models", key, context)
        assert status == 401 and answer["error"]["code"] == "invalid_api_key"
    with openai.DefaultHttpxClient(verify=context or True, timeout=60) as transport, \
            openai.OpenAI(base_url=url + "/v1", api_key=mesh.api_key(), http_client=transport, max_retries=0) as c:
        out = c.completions.create(model="", prompt=VICTIM_PROMPT, max_tokens=12, temperature=0,
                                   extra_body={"ignore_eos": True, "return_token_ids": True})
    assert out.choices[0].token_ids == victim
    if not mesh.tls:
        return
    with pytest.raises(urllib.error.URLError) as refused:   # the system's CAs do not know the mesh CA
        _http_get(url + "/v1/models", mesh.api_key(), ssl.create_default_context())
    assert isinstance(refused.value.reason, ssl.SSLCertVerificationError)
    with pytest.raises((ConnectionError, http.client.HTTPException, urllib.error.URLError)):
        _http_get(url.replace("https://", "http://") + "/v1/models", mesh.api_key())


def test_with_tls_the_certificates_are_the_identity_and_outsiders_get_nothing(tls_mesh, victim):
    certs = tls_mesh.certs
    ca_only = tls_files(str(certs), None)
    admin_cert = tls_files(str(certs), "admin")
    decode = tls_mesh.services["decode-0"].address
    ping = engine_pb2.EngineStatsRequest()
    # plaintext, or TLS without a certificate: no handshake at all on an internal port
    with client_channel(decode, sync=True) as ch:
        assert call_code(engine_pb2_grpc.DecodeStub(ch).GetEngineStats, ping) == grpc.StatusCode.UNAVAILABLE
    with client_channel(decode, tls=ca_only, sync=True) as ch:
        assert call_code(engine_pb2_grpc.DecodeStub(ch).GetEngineStats, ping) == grpc.StatusCode.UNAVAILABLE
    # a mesh certificate that is not a service's (the operator's) may not call internal RPCs
    req = engine_pb2.DecodeRequest(request_id="bypass", prompt_token_ids=VICTIM_PROMPT,
                                   sampling=common_pb2.SamplingParams(max_tokens=4))
    with client_channel(decode, tls=admin_cert, sync=True) as ch:
        assert call_code(engine_pb2_grpc.DecodeStub(ch).Generate, req) == P
    with client_channel(tls_mesh.meta_address, tls=admin_cert, sync=True) as ch:
        assert call_code(meta_pb2_grpc.MetaServerStub(ch).ListMembers, meta_pb2.ListMembersRequest()) == P
        assert call_code(meta_pb2_grpc.MetaAdminStub(ch).DrainNode, meta_pb2.DrainNodeRequest(node_id="decode-0")) == U
    # a service certificate names its own node only: the kv-store's may not send KV to decode-0
    dest = engine_pb2.KVDestination(node_id="decode-0", transfer_endpoint="127.0.0.1:1", block_ids=[0, 1])
    with client_channel(tls_mesh.services["prefill-0"].address, tls=tls_files(str(certs), "kv-store"),
                        sync=True) as ch:
        req = engine_pb2.PrefillRequest(request_id="evil", prompt_token_ids=VICTIM_PROMPT[:32], destination=dest,
                                        sampling=common_pb2.SamplingParams(max_tokens=1))
        assert call_code(engine_pb2_grpc.PrefillStub(ch).Prefill, req) == P
    # a service registers, reports and leaves only under its own name, and cannot claim a
    # live node's transfer endpoint under another name
    with tls_mesh.admin_channel() as ch:
        real = next(n.info for n in meta_pb2_grpc.MetaAdminStub(ch).ListNodes(
            meta_pb2.ListNodesRequest(), timeout=5).nodes if n.info.node_id == "decode-0")
    with client_channel(tls_mesh.meta_address, tls=tls_files(str(certs), "gateway"), sync=True) as ch:
        meta = meta_pb2_grpc.MetaServerStub(ch)
        forged = common_pb2.NodeInfo()
        forged.CopyFrom(real)
        assert call_code(meta.Register, meta_pb2.RegisterRequest(node=forged, instance_id="x")) == P
        assert call_code(meta.Deregister, meta_pb2.DeregisterRequest(node_id="decode-0")) == P
        forged.node_id = "gateway"
        assert call_code(meta.Register, meta_pb2.RegisterRequest(node=forged, instance_id="x")) == P
    # the public port: TLS without a client certificate, the API key still required
    with client_channel(tls_mesh.gateway_address, tls=ca_only, sync=True) as ch:
        assert call_code(gateway_pb2_grpc.GatewayStub(ch).ListModels, gateway_pb2.ListModelsRequest()) == U
    with client_channel(tls_mesh.gateway_address, sync=True) as ch:   # plaintext to a TLS port
        assert call_code(gateway_pb2_grpc.GatewayStub(ch).ListModels, gateway_pb2.ListModelsRequest()) == \
            grpc.StatusCode.UNAVAILABLE
    # end to end over TLS (gateway -> meta-server -> decode -> prefill over mTLS, no secret
    # anywhere): the same tokens as the plaintext mesh
    assert generate(tls_mesh) == victim
