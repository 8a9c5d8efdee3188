"""Fuzz of every pdmesh gRPC API (hypothesis) against one real mesh in this process: a
meta-server, a `both` node and a prefill node (tiny model, fake transfer), a gateway with
an API keys file and a kv-store, on an event loop in a thread; every request goes as raw
bytes over a real channel.

- Gateway.Generate: GenerateRequests from strategies (model, text or token-id prompt,
  every sampling field inside and past its bounds, long request ids) and raw bytes
  (invalid UTF-8 in a string field, garbage, damaged messages), each with a client key,
  the admin token, no key, a wrong key, or only the cluster secret. A valid key gets a
  stream ending with a finish_reason (always, for a request inside every bound),
  INVALID_ARGUMENT or RESOURCE_EXHAUSTED; anyone else UNAUTHENTICATED.
- Every other method of Gateway, MetaServer, MetaAdmin, Decode, Prefill, KVStore and WeightSeed:
  messages built from the descriptors (some aimed at the real mesh: coherent_requests)
  and raw bytes, with each credential. An admitted caller gets OK, INVALID_ARGUMENT,
  RESOURCE_EXHAUSTED, PERMISSION_DENIED, or a code the method's proto documents
  (EXTRA_CODES); any other caller is refused (UNAUTHENTICATED / PERMISSION_DENIED, never
  OK) and changes nothing: the registry, the drained nodes and the policy stay as they were.
- After each test: the services still serve (a normal request gets its tokens), the real
  nodes are registered at their addresses by their own processes, and neither engine
  holds or quarantines a block.

String fields are also drawn from the ids earlier calls sent or got (SEEN), so that
CommitPut, Release, Heartbeat and CancelPrefill reach live records; a failing example's
replay may then differ (hypothesis reports the first failure as it happened).
"""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protos.pdmesh.v1 import gateway_pb2
from tests.fuzz_mesh import API_KEY, C, CREDENTIALS, FUZZ, GENERATE, GENERATE_PATH, Mesh, SERVICES
from tests.fuzz_strategies import calls_of, credentials_for, generate_requests, raw_bytes

pytestmark = pytest.mark.timeout(240)
IDLE_GUARD_S = 30.0     # for the engines to go idle after the fuzz: only catches a leak, never a slow host


# ---- who may call what (services/security/server_auth.py's table) --------------------
STATS_READ_BY_ADMIN = {"/pdmesh.v1.KVStore/Stats", "/pdmesh.v1.Decode/GetEngineStats",
                       "/pdmesh.v1.Prefill/GetEngineStats"}


def allowed(path: str, credential: str) -> bool:
    if path.startswith("/pdmesh.v1.Gateway/"):
        return credential in ("client_key", "admin_token")
    if path.startswith("/pdmesh.v1.MetaAdmin/"):
        return credential == "admin_token"
    return credential == "cluster_secret" or (credential == "admin_token" and path in STATS_READ_BY_ADMIN)


# Codes an allowed call may end with besides OK and BASE_CODES: only those the method's
# proto documents. Every method served is listed (a new RPC must be added here).
BASE_CODES = {C.INVALID_ARGUMENT, C.RESOURCE_EXHAUSTED, C.PERMISSION_DENIED}
EXTRA_CODES = {
    "/pdmesh.v1.Gateway/Generate": set(),
    "/pdmesh.v1.Gateway/Tokenize": set(),
    "/pdmesh.v1.Gateway/ListModels": set(),
    "/pdmesh.v1.MetaServer/Register": set(),
    "/pdmesh.v1.MetaServer/Heartbeat": {C.NOT_FOUND},        # "NOT_FOUND: register again"
    "/pdmesh.v1.MetaServer/Deregister": set(),
    "/pdmesh.v1.MetaServer/Route": {C.UNAVAILABLE},          # "UNAVAILABLE: no decode node"
    "/pdmesh.v1.MetaServer/ListMembers": set(),
    "/pdmesh.v1.MetaServer/ReportRequests": {C.FAILED_PRECONDITION},   # "FAILED_PRECONDITION on a standby"
    "/pdmesh.v1.WeightSeed/OpenWeights": {C.FAILED_PRECONDITION, C.UNAVAILABLE},   # another identity; cannot expose
    "/pdmesh.v1.WeightSeed/RenewWeights": {C.NOT_FOUND},     # "NOT_FOUND: it lapsed"
    "/pdmesh.v1.WeightSeed/CloseWeights": set(),
    "/pdmesh.v1.MetaAdmin/ListNodes": set(),
    "/pdmesh.v1.MetaAdmin/DrainNode": {C.NOT_FOUND},         # "Unknown node id: NOT_FOUND"
    "/pdmesh.v1.MetaAdmin/UndrainNode": {C.NOT_FOUND},
    "/pdmesh.v1.MetaAdmin/RemoveNode": {C.NOT_FOUND},
    "/pdmesh.v1.MetaAdmin/GetPolicy": set(),
    "/pdmesh.v1.MetaAdmin/SetPolicy": set(),
    "/pdmesh.v1.MetaAdmin/GetStats": set(),
    "/pdmesh.v1.MetaAdmin/GetPlanner": set(),
    "/pdmesh.v1.Decode/Generate": set(),
    "/pdmesh.v1.Decode/GetEngineStats": set(),
    "/pdmesh.v1.Prefill/Prefill": {C.CANCELLED},             # "a request id that a CancelPrefill named first"
    "/pdmesh.v1.Prefill/CancelPrefill": set(),
    "/pdmesh.v1.Prefill/GetEngineStats": set(),
    "/pdmesh.v1.KVStore/Lookup": set(),
    "/pdmesh.v1.KVStore/ReservePut": set(),
    "/pdmesh.v1.KVStore/CommitPut": {C.NOT_FOUND},           # "NOT_FOUND (unknown or expired put_id / pin_id)"
    "/pdmesh.v1.KVStore/PinGet": set(),
    "/pdmesh.v1.KVStore/Release": {C.NOT_FOUND},
    "/pdmesh.v1.KVStore/Stats": set(),
}


def violation(path: str, credential: str, code: C, details: str) -> str | None:
    """Why this outcome breaks the contract, None if it does not."""
    if not allowed(path, credential):
        if credential in ("none", "wrong_secret", "wrong_key"):
            ok = code == C.UNAUTHENTICATED
        else:
            ok = code in (C.UNAUTHENTICATED, C.PERMISSION_DENIED)
        return None if ok else f"{path} with {credential} must be refused, got {code.name}: {details!r}"
    if code == C.OK or code in BASE_CODES or code in EXTRA_CODES[path]:
        return None
    return f"{path} with {credential}: {code.name} is not an allowed outcome: {details!r}"




@pytest.fixture(scope="module")
def mesh(tiny_model, tmp_path_factory):
    keys = tmp_path_factory.mktemp("fuzz") / "api_keys"
    keys.write_text(f"# fuzz clients\n{API_KEY}\n")
    m = Mesh()
    try:
        m.run(m.start(tiny_model("llama"), keys), timeout=120)
        yield m
        m.run(m.close(), timeout=60)
    finally:
        m.loop.call_soon_threadsafe(m.loop.stop)
        m.thread.join(10)
        if not m.thread.is_alive():
            m.loop.close()


# ---- the tests ----------------------------------------------------------------------


def test_generate_requests_fuzzed_end_in_tokens_or_a_client_error(mesh):
    assert mesh.run(mesh.generate_tokens())
    requests = generate_requests()
    sent = st.one_of(requests.map(lambda rv: (rv[0].SerializeToString(), rv[1])),
                     raw_bytes(requests.map(lambda rv: rv[0]), gateway_pb2.GenerateRequest.DESCRIPTOR)
                     .map(lambda data: (data, False)))
    credentials = st.one_of(st.just("client_key"), st.sampled_from(CREDENTIALS))

    @FUZZ
    @given(sent=sent, credential=credentials)
    def fuzz(sent, credential):
        (data, valid), path = sent, GENERATE_PATH
        code, details, replies = mesh.run(mesh.call("gateway", GENERATE, data, credential))
        bad = violation(path, credential, code, details)
        if code == C.OK:
            tokens = [t for r in replies for t in r.token_ids]
            max_tokens = gateway_pb2.GenerateRequest.FromString(data).sampling.max_tokens
            if not replies or replies[-1].finish_reason not in ("stop", "length"):
                bad = f"the stream ended without a finish_reason: {replies[-1:]}"
            elif len(tokens) > max_tokens:
                bad = f"{len(tokens)} tokens for max_tokens={max_tokens}"
        elif valid and allowed(path, credential):
            bad = f"a valid request with a valid key failed: {code.name} {details!r}"
        elif code == C.PERMISSION_DENIED and allowed(path, credential):
            bad = f"a valid key was refused: {details!r}"
        assert bad is None, bad

    fuzz()
    assert mesh.run(mesh.generate_tokens())
    mesh.run(mesh.assert_no_blocks_in_use(IDLE_GUARD_S), timeout=2 * IDLE_GUARD_S)


@pytest.mark.parametrize("service", ["MetaServer", "MetaAdmin", "Decode", "Prefill", "KVStore", "Gateway",
                                     "WeightSeed"])
def test_every_rpc_fuzzed_with_every_credential(mesh, service):
    descriptor, server = SERVICES[service]
    assert {f"/{descriptor.full_name}/{m.name}" for m in descriptor.methods} <= EXTRA_CODES.keys()

    @FUZZ
    @given(call=calls_of(mesh, service), credential=credentials_for(service))
    def fuzz(call, credential):
        (method, data), path = call, f"/{descriptor.full_name}/{call[0].name}"
        before = mesh.run(mesh.snapshot())
        code, details, _ = mesh.run(mesh.call(server, method, data, credential))
        bad = violation(path, credential, code, details)
        if bad is None and not allowed(path, credential):
            changed = mesh.unchanged(before, mesh.run(mesh.snapshot()))
            bad = changed and f"{path} refused to {credential} changed the mesh: {changed}"
        assert bad is None, bad

    try:
        fuzz()
    finally:   # the next test starts from the real mesh even when this one failed
        mesh.run(mesh.restore())
    assert mesh.run(mesh.generate_tokens())
    mesh.run(mesh.assert_no_blocks_in_use(IDLE_GUARD_S), timeout=2 * IDLE_GUARD_S)
