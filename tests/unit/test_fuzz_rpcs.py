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
- Every other method of Gateway, MetaServer, MetaAdmin, Decode, Prefill and KVStore:
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

import asyncio
import dataclasses
import os
import threading
import time

import grpc
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import FieldDescriptor as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.config import (KVStoreConfig, LimitsConfig, MeshConfig, MetaConfig, NodeConfig, TimeoutConfig,
                           TransferConfig)
from protos.pdmesh.v1 import common_pb2, engine_pb2, gateway_pb2, kv_store_pb2, meta_pb2
from services.gateway import server as gateway_server
from services.kv_store import server as kv_store_server
from services.meta_server import server as meta_server
from services.node.grpc_util import CHANNEL_OPTIONS
from services.node.node_server import create_node_server, stop_node_server
from services.security.credentials import load_credentials
from tests.conftest import assert_no_blocks_in_use

pytestmark = pytest.mark.timeout(240)
C = grpc.StatusCode
TTL = 10.0   # no case needs a lease to lapse: a long one survives a stalled host
MAX_MODEL_LEN = 128
VOCAB = 1024
MODEL_ID = "tiny"
API_KEY = "fuzz-client-key-" + os.urandom(8).hex()
LIMITS = LimitsConfig(max_prompt_bytes=2048, max_prompt_token_ids=256, max_stop_strings=4,
                      max_stop_string_bytes=32, max_stop_token_ids=16, max_request_id_bytes=64)
TIMEOUTS = TimeoutConfig(transfer_s=0.3, cancel_ack_s=1.0, prefill_s=10.0, request_s=60.0,
                         kv_store_pin_lease_s=5.0, kv_store_reserve_lease_s=5.0)
FUZZ = settings(max_examples=150, deadline=None, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])

CREDENTIALS = ("none", "wrong_secret", "wrong_key", "client_key", "admin_token", "cluster_secret")


def metadata(credential: str) -> tuple[tuple[str, str], ...]:
    return {
        "none": (),
        "wrong_secret": (("x-pdmesh-cluster-secret", "not-the-cluster-secret-0123456789"),),
        "wrong_key": (("authorization", "Bearer not-a-key-0123456789abcdef"),),
        "client_key": (("authorization", f"Bearer {API_KEY}"),),
        "admin_token": (("authorization", f"Bearer {os.environ['PDMESH_ADMIN_TOKEN']}"),),
        "cluster_secret": (("x-pdmesh-cluster-secret", os.environ["PDMESH_CLUSTER_SECRET"]),),
    }[credential]


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
    "/pdmesh.v1.MetaAdmin/ListNodes": set(),
    "/pdmesh.v1.MetaAdmin/DrainNode": {C.NOT_FOUND},         # "Unknown node id: NOT_FOUND"
    "/pdmesh.v1.MetaAdmin/UndrainNode": {C.NOT_FOUND},
    "/pdmesh.v1.MetaAdmin/RemoveNode": {C.NOT_FOUND},
    "/pdmesh.v1.MetaAdmin/GetPolicy": set(),
    "/pdmesh.v1.MetaAdmin/SetPolicy": set(),
    "/pdmesh.v1.MetaAdmin/GetStats": set(),
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
SERVICES = {   # service -> (its descriptor, the mesh's server that serves it)
    "Gateway": (gateway_pb2.DESCRIPTOR.services_by_name["Gateway"], "gateway"),
    "MetaServer": (meta_pb2.DESCRIPTOR.services_by_name["MetaServer"], "meta"),
    "MetaAdmin": (meta_pb2.DESCRIPTOR.services_by_name["MetaAdmin"], "meta"),
    "Decode": (engine_pb2.DESCRIPTOR.services_by_name["Decode"], "both"),
    "Prefill": (engine_pb2.DESCRIPTOR.services_by_name["Prefill"], "prefill"),
    "KVStore": (kv_store_pb2.DESCRIPTOR.services_by_name["KVStore"], "store"),
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


# ---- the mesh -----------------------------------------------------------------------
class Mesh:
    """The services on an event loop in a thread; run(coro) from the test's thread."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fuzz mesh", daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def start(self, model, keys_file) -> None:
        self.meta, meta_port = await meta_server.create_server(MetaConfig(port=0, ttl_seconds=TTL))
        self.cfg = MeshConfig(model=str(model), model_id=MODEL_ID, meta=MetaConfig(port=meta_port, ttl_seconds=TTL),
                              engine={"num_blocks": 64, "max_model_len": MAX_MODEL_LEN},
                              transfer=TransferConfig(backend="fake"), timeouts=TIMEOUTS, limits=LIMITS)
        self.both, both_port = await create_node_server(self.cfg, NodeConfig("both", "both-0"), 0)
        self.prefill, prefill_port = await create_node_server(self.cfg, NodeConfig("prefill", "prefill-0"), 0)
        creds = load_credentials(self.cfg.security, "gateway", api_keys_file=str(keys_file))
        self.gateway, gateway_port = await gateway_server.create_server(self.cfg, port=0, credentials=creds)
        store_cfg = dataclasses.replace(self.cfg, kv_store=KVStoreConfig(port=0, capacity_mb=1.0))
        self.store, store_port = await kv_store_server.create_server(store_cfg, port=0)
        self.addresses = {name: f"127.0.0.1:{port}" for name, port in (
            ("meta", meta_port), ("both", both_port), ("prefill", prefill_port), ("gateway", gateway_port),
            ("store", store_port))}
        self.channels = {name: grpc.aio.insecure_channel(a, options=CHANNEL_OPTIONS)
                         for name, a in self.addresses.items()}
        self.real = {"both-0": (self.addresses["both"], self.both.node.registration.instance_id),
                     "prefill-0": (self.addresses["prefill"], self.prefill.node.registration.instance_id)}
        self.policy = self.meta.control.policy()
        await self.wait_for_real_members()

    async def close(self) -> None:
        for ch in self.channels.values():
            await ch.close()
        await self.gateway.stop(None)
        await self.gateway.servicer.close()
        await kv_store_server.stop_server(self.store, 0)
        await stop_node_server(self.both, 0.5)
        await stop_node_server(self.prefill, 0.5)
        await self.meta.stop(None)
        await self.meta.close_extras()

    async def call(self, server: str, method, data: bytes, credential: str, timeout: float = 20.0):
        """(code, details, replies) of one call with these exact request bytes."""
        path = f"/{method.containing_service.full_name}/{method.name}"
        reply_cls = message_factory.GetMessageClass(method.output_type)
        ch, md = self.channels[server], metadata(credential)
        replies = []
        try:
            if method.server_streaming:
                call = ch.unary_stream(path, request_serializer=None, response_deserializer=reply_cls.FromString)
                async for reply in call(data, metadata=md, timeout=timeout):
                    replies.append(reply)
            else:
                call = ch.unary_unary(path, request_serializer=None, response_deserializer=reply_cls.FromString)
                replies.append(await call(data, metadata=md, timeout=timeout))
        except grpc.aio.AioRpcError as e:
            return e.code(), e.details(), replies
        finally:
            _remember_ids(method.input_type, data, replies)
        return C.OK, "", replies

    async def snapshot(self) -> tuple[dict, tuple]:
        """What a call may change: the members (node_id -> (instance_id, info without load,
        state)), and the drained ids, the policy, the prefill node's cancelled ids and the
        kv-store's counters that only calls move."""
        members = {}
        for m in self.meta.control.registry.members():
            info = common_pb2.NodeInfo()
            info.CopyFrom(m.info)
            info.ClearField("load")
            members[m.node_id] = (m.instance_id, info.SerializeToString(deterministic=True), m.state)
        admin, store = self.meta.control.admin, self.store.store.stats()
        return members, (set(admin.drained_node_ids()), admin.policy(), list(self.prefill.servicer.cancelled),
                         [store[k] for k in ("num_spaces", "hits", "misses", "bytes_in", "bytes_out")])

    def unchanged(self, before, after) -> str | None:
        """None when `after` differs from `before` only by what time and the real nodes
        do: members going down or forgotten once down, the real nodes joining again."""
        (b_members, b_rest), (a_members, a_rest) = before, after
        if b_rest != a_rest:
            return f"{b_rest} -> {a_rest}"
        real_instances = {instance for _, instance in self.real.values()}
        for node_id in b_members.keys() | a_members.keys():
            b, a = b_members.get(node_id), a_members.get(node_id)
            if (a is not None and b is not None and a[:2] == b[:2]) or (a is None and b[2] == "down") \
                    or (a is not None and a[0] in real_instances):
                continue
            return f"member {node_id!r}: {b} -> {a}"
        return None

    async def wait_for_real_members(self, timeout_s: float = 4 * TTL) -> None:
        """Until both real nodes are up in the registry, at their addresses, joined by their
        own processes."""
        start = time.monotonic()
        while True:
            members = {m.node_id: m for m in self.meta.control.registry.alive()}
            if all(n in members and (members[n].info.address, members[n].instance_id) == real
                   for n, real in self.real.items()):
                return
            assert time.monotonic() - start < timeout_s, \
                f"real nodes not registered: {[(m.node_id, m.info.address) for m in members.values()]}"
            await asyncio.sleep(0.05)

    async def restore(self) -> None:
        """Undo what allowed calls did: members not joined by the real nodes removed,
        nothing drained, the policy back; then wait for the real nodes."""
        for m in list(self.meta.control.registry.members()):
            if self.real.get(m.node_id, ("", ""))[1] != m.instance_id:
                await self.meta.control.remove(m.node_id)
        for node_id in list(self.meta.control.admin.drained_node_ids()):
            await self.meta.control.undrain(node_id)
        await self.meta.control.set_policy(self.policy)
        await self.wait_for_real_members()

    async def assert_no_blocks_in_use(self, timeout_s: float = 5.0) -> None:
        """Both engines idle (nothing running, waiting, remote, held or quarantined),
        then the shared leak check on each."""
        for server in (self.both, self.prefill):
            start = time.monotonic()
            while True:
                s = await server.node.engine.stats()
                if not (s["used_blocks"] or s["quarantined_blocks"] or s["running"] or s["waiting"]
                        or s["kv_remote"] or s["held"]):
                    break
                assert time.monotonic() - start < timeout_s, f"{server.node.node.node_id} not idle: {s}"
                await asyncio.sleep(0.05)
            assert_no_blocks_in_use(server.node.llm_engine)

    async def generate_tokens(self) -> list[int]:
        """A normal request through the gateway: its tokens."""
        req = gateway_pb2.GenerateRequest(prompt="the quick brown fox",
                                          sampling=common_pb2.SamplingParams(max_tokens=3, ignore_eos=True))
        code, details, replies = await self.call("gateway", GENERATE, req.SerializeToString(), "client_key")
        assert code == C.OK, (code, details)
        assert replies[-1].finish_reason == "length"
        return [t for r in replies for t in r.token_ids]


def _remember_ids(request_type, data: bytes, replies: list) -> None:
    try:
        messages = [message_factory.GetMessageClass(request_type).FromString(data), *replies]
    except Exception:   # the raw bytes were not a message
        messages = replies
    for msg in messages:
        for name in SEEN_FIELDS:
            value = getattr(msg, name) if name in msg.DESCRIPTOR.fields_by_name else ""
            if value and len(value) <= 64 and value not in SEEN:
                SEEN.append(value)
    del SEEN[:-64]


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


# ---- strategies ---------------------------------------------------------------------
SEEN: list[str] = []     # ids sent or answered (SEEN_FIELDS), newest last; see the module doc
SEEN_FIELDS = ("put_id", "pin_id", "request_id", "instance_id", "node_id")
WEIRD = st.sampled_from(["\x00", "\u202e\u202d", "\ufeff", "\U0001f600" * 8, "a\u0301" * 20, "\U0010ffff",
                         "\r\n\t", "\u0085\u2028", "<|endoftext|>", "</s>", "\\xff"])
TEXT = st.one_of(st.text(st.characters(exclude_categories=("Cs",)), max_size=40), WEIRD)
LONG_TEXT = st.integers(33, 5000).map(lambda n: ("zé" * n)[:n])
INT32 = st.one_of(st.integers(-3, 70), st.sampled_from([-2**31, 2**31 - 1, VOCAB - 1, VOCAB, 4096]),
                  st.integers(-2**31, 2**31 - 1))
FLOAT = st.one_of(st.sampled_from([0.0, 0.5, 1.0, 2.0, -0.5, -1.0, 1e-45, 3.4e38, 1e39]), st.floats(width=32))
MAX_TOKENS = st.one_of(st.integers(1, 4), st.sampled_from([0, -1, -2**31, 2**31 - 1, 10**6, MAX_MODEL_LEN]))
NAMES = ["", "both-0", "prefill-0", "fuzz-0", MODEL_ID, "both", "decode", "prefill", "root", "fake", "grpc",
         "round_robin", "least_load", "cache_aware", "float32", "127.0.0.1:1", "fake:1", "a" * 257]
STRING = st.one_of(st.sampled_from(NAMES), TEXT, LONG_TEXT.map(lambda s: s[:400]),
                   st.integers(1, 64).map(lambda i: SEEN[-i] if len(SEEN) >= i else ""))


def token_ids(valid: bool = False):
    good = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=60)
    if valid:
        return good
    out = st.sampled_from([-1, -2**31, VOCAB, VOCAB + 1, 2**31 - 1])
    return st.one_of(good, st.lists(st.one_of(st.integers(0, VOCAB - 1), out), max_size=60),
                     st.integers(MAX_MODEL_LEN, 400).map(lambda n: [7] * n))


def picker(draw, valid: bool):
    """pick(good, bad): a value of good when valid, else of either."""
    return lambda good, bad: draw(good if valid else st.one_of(good, bad))


@st.composite
def sampling_params(draw, valid: bool) -> common_pb2.SamplingParams:
    pick = picker(draw, valid)
    s = common_pb2.SamplingParams(max_tokens=pick(st.integers(1, 4), MAX_TOKENS),
                                  temperature=pick(st.floats(0, 2, width=32), FLOAT),
                                  top_p=pick(st.one_of(st.just(0.0), st.floats(0.125, 1, width=32)), FLOAT),
                                  top_k=pick(st.one_of(st.sampled_from([0, -1]), st.integers(1, 2 * VOCAB)), INT32),
                                  ignore_eos=draw(st.booleans()))
    if draw(st.booleans()):
        s.seed = draw(st.integers(0, 2**64 - 1))
    s.stop.extend(pick(st.lists(st.text(min_size=1, max_size=8), max_size=LIMITS.max_stop_strings),
                       st.lists(st.one_of(TEXT, LONG_TEXT.map(lambda t: t[:100])), max_size=6)))
    s.stop_token_ids.extend(pick(st.lists(st.integers(0, VOCAB - 1), max_size=LIMITS.max_stop_token_ids),
                                 st.lists(st.one_of(st.integers(0, VOCAB - 1), INT32), max_size=20)))
    return s


@st.composite
def generate_requests(draw) -> tuple[gateway_pb2.GenerateRequest, bool]:
    """(request, valid): a valid one has every field inside its bounds (and must succeed);
    the others have each field inside or outside them."""
    valid = draw(st.booleans())
    pick = picker(draw, valid)
    req = gateway_pb2.GenerateRequest(model=pick(st.sampled_from(["", MODEL_ID]), st.one_of(st.just("m" * 5000), TEXT)),
                                      request_id=pick(st.text(max_size=16), st.one_of(TEXT, LONG_TEXT)))
    which = pick(st.sampled_from(["prompt", "ids"]), st.just("none"))
    if which == "prompt":   # <= 20 characters: at most 81 tokens, so max_tokens fits in max_model_len
        req.prompt = pick(st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=20),
                          st.one_of(st.just(""), TEXT, LONG_TEXT))
    elif which == "ids":
        req.prompt_token_ids.SetInParent()
        req.prompt_token_ids.ids.extend(draw(token_ids(valid)))
    if valid or draw(st.booleans()):
        req.sampling.CopyFrom(draw(sampling_params(valid)))
    return req, valid


def _length_delimited(number: int, payload: bytes) -> bytes:
    def varint(n: int) -> bytes:
        out = bytearray()
        while True:
            out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
            n >>= 7
            if not n:
                return bytes(out)
    return varint(number << 3 | 2) + varint(len(payload)) + payload


BAD_UTF8 = st.tuples(st.binary(max_size=8), st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xc0\xaf",
                                                             b"\xf4\x90\x80\x80", b"\x80"])).map(b"".join)


def string_paths(descriptor, depth: int = 0) -> list[tuple[int, ...]]:
    """Field-number paths of every string field of a message, nested ones included."""
    paths = []
    for f in descriptor.fields:
        if f.type == F.TYPE_STRING:
            paths.append((f.number,))
        elif f.type == F.TYPE_MESSAGE and depth < 3:
            paths.extend((f.number, *p) for p in string_paths(f.message_type, depth + 1))
    return paths


def raw_bytes(messages: st.SearchStrategy, descriptor) -> st.SearchStrategy[bytes]:
    """Bytes that are not a valid message: a valid one followed by a string field (maybe
    nested) of invalid UTF-8, garbage, or a valid one truncated or with a byte changed."""
    def spliced(args):
        msg, path, payload = args
        for number in reversed(path):
            payload = _length_delimited(number, payload)
        return msg.SerializeToString() + payload

    def damaged(args):
        msg, cut, flip = args
        data = msg.SerializeToString() or b"\x0a"
        i = cut % len(data)
        return data[:i] if flip is None else data[:i] + bytes([data[i] ^ flip]) + data[i + 1:]

    strategies = [st.binary(max_size=64),
                  st.tuples(messages, st.integers(0, 10**6), st.one_of(st.none(), st.integers(1, 255))).map(damaged)]
    if string_paths(descriptor):
        strategies.append(st.tuples(messages, st.sampled_from(string_paths(descriptor)), BAD_UTF8).map(spliced))
    return st.one_of(*strategies)


def scalar(field) -> st.SearchStrategy:
    t = field.type
    if t == F.TYPE_STRING:
        return STRING
    if t == F.TYPE_BYTES:
        return st.one_of(st.binary(max_size=40), st.binary(min_size=16, max_size=16))
    if t == F.TYPE_BOOL:
        return st.booleans()
    if t == F.TYPE_FLOAT:
        return FLOAT
    if t == F.TYPE_DOUBLE:
        return st.one_of(st.sampled_from([0.0, 1.0, -1.0, 1e308]), st.floats())
    if t in (F.TYPE_INT32, F.TYPE_SINT32, F.TYPE_SFIXED32):
        return INT32
    bits = 64 if t in (F.TYPE_INT64, F.TYPE_SINT64, F.TYPE_SFIXED64, F.TYPE_UINT64, F.TYPE_FIXED64) else 32
    low = -2**(bits - 1) if t in (F.TYPE_INT64, F.TYPE_SINT64, F.TYPE_SFIXED64) else 0
    high = 2**(bits - 1) - 1 if low else 2**bits - 1
    assert t in (F.TYPE_INT64, F.TYPE_SINT64, F.TYPE_SFIXED64, F.TYPE_UINT64, F.TYPE_FIXED64,
                 F.TYPE_UINT32, F.TYPE_FIXED32), f"no strategy for {field.full_name} (type {t})"
    return st.one_of(st.integers(max(low, -3), 70), st.sampled_from([low, high]), st.integers(low, high))


def messages(descriptor, overrides: dict | None = None, path: str = "", depth: int = 0):
    """Any message of `descriptor`: each field unset or drawn by its type, repeated ones as
    short lists, nested messages likewise. overrides: "a.b" -> a strategy of that field's
    whole value, None for unset (keeps costly fields cheap, or aims them at the mesh)."""
    overrides = overrides or {}
    fields = []
    for f in descriptor.fields:
        name = path + f.name
        if name in overrides:
            fields.append((f, True, overrides[name]))
            continue
        if f.type == F.TYPE_MESSAGE:
            value = messages(f.message_type, overrides, name + ".", depth + 1) if depth < 3 else \
                st.just(message_factory.GetMessageClass(f.message_type)())
        else:
            value = scalar(f)
        fields.append((f, False, st.lists(value, max_size=4) if f.is_repeated else value))
    cls = message_factory.GetMessageClass(descriptor)

    @st.composite
    def build(draw):
        msg = cls()
        for f, overridden, strategy in fields:
            if not overridden and not draw(st.booleans()):
                continue
            value, target = draw(strategy), getattr(msg, f.name)
            if value is None:
                continue
            if f.is_repeated and f.type == F.TYPE_MESSAGE:
                for v in value:
                    target.add().CopyFrom(v)
            elif f.is_repeated:
                target.extend(value)
            elif f.type == F.TYPE_MESSAGE:
                target.SetInParent()
                target.MergeFrom(value)
            else:
                setattr(msg, f.name, value)
        return msg
    return build()


def overrides_for(mesh: Mesh) -> dict[str, dict]:
    """Per method: fields kept cheap or aimed at the real mesh. A decode node dials a
    DecodeRequest's prefill address: only the real prefill node, a port that refuses at
    once, or none (an address that does not resolve leaves the request's blocks
    quarantined until its deadline, by design)."""
    both = mesh.both.node.node_info()
    address = st.sampled_from([mesh.addresses["prefill"], "127.0.0.1:1", ""])
    engine_request = {"sampling": st.one_of(sampling_params(True), sampling_params(False),
                                            messages(common_pb2.SamplingParams.DESCRIPTOR)),
                      "prompt_token_ids": st.one_of(token_ids(True), token_ids()),
                      "resume_position": st.one_of(st.just(0), st.integers(0, 50))}
    node_info = st.builds(
        lambda node_id, role, address, layout: common_pb2.NodeInfo(node_id=node_id, role=role, address=address,
                                                                   model_id=MODEL_ID, kv_layout=layout),
        st.one_of(st.sampled_from(["fuzz-0", "fuzz-1", "both-0", "prefill-0"]), STRING),
        st.sampled_from(["prefill", "decode", "both", "root", ""]), st.sampled_from(["127.0.0.1:1", "", "x"]),
        st.one_of(st.just(both.kv_layout), messages(common_pb2.KVLayout.DESCRIPTOR)))
    space = st.one_of(st.just(kv_store_pb2.KeySpace(model_id=MODEL_ID, layout=both.kv_layout)),
                      messages(kv_store_pb2.KeySpace.DESCRIPTOR))
    return {
        "Decode.Generate": {**engine_request, "prefill.address": address, "prefill_fallbacks.address": address},
        "Prefill.Prefill": engine_request,
        "MetaServer.Register": {"node": st.one_of(node_info, messages(common_pb2.NodeInfo.DESCRIPTOR))},
        "KVStore.Lookup": {"space": space},
        "KVStore.ReservePut": {"space": space},
        "KVStore.PinGet": {"space": space},
    }


STORE_HASHES = [bytes([i]) * 16 for i in range(4)]   # block i holds 16 tokens i


def coherent_requests(mesh: Mesh) -> dict[str, st.SearchStrategy]:
    """Per method: requests that pass its checks, to reach what lies behind them: a
    prefill into the real decode node's registered destination (it writes into that
    node's blocks, as any mesh member may), kv-store puts and gets of the real space."""
    both = mesh.both.node.node_info()
    space = kv_store_pb2.KeySpace(model_id=MODEL_ID, layout=both.kv_layout)
    blocks = st.lists(st.integers(0, len(STORE_HASHES) - 1), max_size=4)
    prompts = st.integers(1, 64).flatmap(lambda n: st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n))

    def prefill(prompt, sampling, block_ids, rid):
        dest = engine_pb2.KVDestination(node_id="both-0", transfer_endpoint=both.transfer_endpoint,
                                        layout=both.kv_layout, block_ids=block_ids[:(len(prompt) + 15) // 16])
        return engine_pb2.PrefillRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling, destination=dest)

    def store(cls, ids):
        msg = cls(space=space, block_hashes=[STORE_HASHES[i] for i in ids])
        if "token_ids" in cls.DESCRIPTOR.fields_by_name:
            msg.token_ids.extend(i for i in ids for _ in range(16))
        return msg

    return {
        "Prefill.Prefill": st.builds(prefill, prompts, sampling_params(True),
                                     st.lists(st.integers(0, 7), min_size=4, max_size=4), STRING),
        "KVStore.Lookup": blocks.map(lambda ids: store(kv_store_pb2.LookupRequest, ids)),
        "KVStore.ReservePut": blocks.map(lambda ids: store(kv_store_pb2.ReservePutRequest, ids)),
        "KVStore.PinGet": blocks.map(lambda ids: store(kv_store_pb2.PinGetRequest, ids)),
    }


def calls_of(mesh: Mesh, service: str):
    """(method, request bytes) for any method of the service but Gateway.Generate: a third
    generic messages, a third coherent ones (where there are), a third raw bytes."""
    overrides, coherent = overrides_for(mesh), coherent_requests(mesh)
    per_method = []
    for method in SERVICES[service][0].methods:
        if method.full_name != "pdmesh.v1.Gateway.Generate":
            name = f"{service}.{method.name}"
            msgs = messages(method.input_type, overrides.get(name))
            data = st.one_of(msgs.map(lambda m: m.SerializeToString()),
                             coherent.get(name, msgs).map(lambda m: m.SerializeToString()),
                             raw_bytes(msgs, method.input_type))
            per_method.append(st.tuples(st.just(method), data))
    return st.one_of(*per_method)


def credentials_for(service: str):
    """Every credential, the one the service admits most often."""
    best = {"Gateway": "client_key", "MetaAdmin": "admin_token"}.get(service, "cluster_secret")
    return st.one_of(st.just(best), st.sampled_from(CREDENTIALS))


# ---- the tests ----------------------------------------------------------------------
GENERATE = SERVICES["Gateway"][0].methods_by_name["Generate"]
GENERATE_PATH = "/pdmesh.v1.Gateway/Generate"


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
    mesh.run(mesh.assert_no_blocks_in_use())


@pytest.mark.parametrize("service", ["MetaServer", "MetaAdmin", "Decode", "Prefill", "KVStore", "Gateway"])
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

    fuzz()
    mesh.run(mesh.restore())
    assert mesh.run(mesh.generate_tokens())
    mesh.run(mesh.assert_no_blocks_in_use())
