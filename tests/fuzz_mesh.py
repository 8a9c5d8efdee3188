"""The mesh the RPC fuzz test (tests/unit/test_fuzz_rpcs.py) runs against, in this
process on an event loop in a thread, and what it shares with the strategies
(tests/fuzz_strategies.py): the limits, the credentials a call may carry, the ids seen."""
from __future__ import annotations

import asyncio
import dataclasses
import os
import threading
import time

import grpc
from google.protobuf import message_factory
from hypothesis import HealthCheck, settings

from common.config import (KVStoreConfig, LimitsConfig, MeshConfig, MetaConfig, NodeConfig, TimeoutConfig,
                           TransferConfig)
from protos.pdmesh.v1 import common_pb2, engine_pb2, gateway_pb2, kv_store_pb2, meta_pb2, weights_pb2
from services.gateway import server as gateway_server
from services.kv_store import server as kv_store_server
from services.meta_server import server as meta_server
from services.node.grpc_util import CHANNEL_OPTIONS
from services.node.node_server import create_node_server, stop_node_server
from services.security.credentials import load_credentials
from tests.conftest import assert_no_blocks_in_use

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




SERVICES = {   # service -> (its descriptor, the mesh's server that serves it)
    "Gateway": (gateway_pb2.DESCRIPTOR.services_by_name["Gateway"], "gateway"),
    "MetaServer": (meta_pb2.DESCRIPTOR.services_by_name["MetaServer"], "meta"),
    "MetaAdmin": (meta_pb2.DESCRIPTOR.services_by_name["MetaAdmin"], "meta"),
    "Decode": (engine_pb2.DESCRIPTOR.services_by_name["Decode"], "both"),
    "Prefill": (engine_pb2.DESCRIPTOR.services_by_name["Prefill"], "prefill"),
    "KVStore": (kv_store_pb2.DESCRIPTOR.services_by_name["KVStore"], "store"),
    "WeightSeed": (weights_pb2.DESCRIPTOR.services_by_name["WeightSeed"], "both"),
}
GENERATE = SERVICES["Gateway"][0].methods_by_name["Generate"]
GENERATE_PATH = "/pdmesh.v1.Gateway/Generate"


SEEN: list[str] = []     # ids sent or answered (SEEN_FIELDS), newest last; see the module doc
SEEN_FIELDS = ("put_id", "pin_id", "request_id", "instance_id", "node_id")


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
        seed = self.both.node.weight_seed
        return members, (set(admin.drained_node_ids()), admin.policy(), list(self.prefill.servicer.cancelled),
                         [store[k] for k in ("num_spaces", "hits", "misses", "bytes_in", "bytes_out")],
                         (sorted(seed.leases), seed.registered))

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
        nothing drained, the policy back, no weight lease held; then wait for the real nodes."""
        for m in list(self.meta.control.registry.members()):
            if self.real.get(m.node_id, ("", ""))[1] != m.instance_id:
                await self.meta.control.remove(m.node_id)
        for node_id in list(self.meta.control.admin.drained_node_ids()):
            await self.meta.control.undrain(node_id)
        await self.meta.control.set_policy(self.policy)
        await self.both.node.weight_seed.close()    # leases granted end: the weights unregistered
        await self.wait_for_real_members()

    async def assert_no_blocks_in_use(self, timeout_s: float = 30.0) -> None:
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

