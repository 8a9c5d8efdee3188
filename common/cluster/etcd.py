"""Membership, member view and admin store over etcd v3 with `aetcd` (asyncio).

aetcd has no background keepalive, so every lease here is refreshed by its owner's own
task every TTL/3. When etcd dies, calls fail at once with ConnectionFailedError and an
open watch raises it; the gRPC channel reconnects by itself (backoff capped at
`retry_max_s`), but a broken watch must be opened again (from the last seen revision + 1)
and an expired lease granted again. The loops below do that and never raise; each keeps
what it knew (the view, the value to publish) meanwhile.

    cluster = EtcdCluster(EtcdConfig(endpoint="127.0.0.1:2379", cluster="prod"))
    node = cluster.membership();  await node.start("decode", "decode-0", info_bytes, ttl_s=5)
    view = cluster.member_view(on_change=print);  await view.start();  view.members()
    ...;  await node.close();  await view.close();  await cluster.close()

The leader election lives in etcd_election.py and shares the client.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import aetcd
import grpc

from common.cluster.base import (DEFAULT_TTL_S, AdminStore, Backoff, ClusterKeys, Membership,
                                 MemberView, OnChange, RetryLog, StoreUnavailableError,
                                 lease_backoff, lease_ttl_seconds, refresh_interval)
from common.tasks import cancel_task  # noqa: F401 (re-exported: it lived here)

log = logging.getLogger(__name__)

STORE_ERRORS = (aetcd.ClientError, asyncio.TimeoutError, grpc.RpcError, OSError)


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """"host:port" or "http://host:port" -> (host, port)."""
    rest = endpoint.strip()
    if rest.startswith("http://"):
        rest = rest[len("http://"):]
    host, sep, port = rest.rstrip("/").rpartition(":")
    if not sep or not host or "," in rest or "/" in rest.rstrip("/") or not port.isdigit() \
            or not 0 < int(port) < 65536:
        raise ValueError(f"etcd endpoint {endpoint!r}: one 'host:port' or 'http://host:port' "
                         "with port 1-65535 (TLS and endpoint lists are not supported)")
    return host, int(port)


@dataclass(frozen=True)
class EtcdConfig:
    endpoint: str = "127.0.0.1:2379"
    cluster: str = "default"            # the <cluster> in /pdmesh/<cluster>/...
    timeout_s: float = 2.0              # per RPC, and for creating a watch
    retry_max_s: float = 1.0            # cap of every retry backoff, and of gRPC reconnects
    username: str | None = None
    password: str | None = None

    def __post_init__(self):
        parse_endpoint(self.endpoint)
        ClusterKeys(self.cluster)
        if not self.timeout_s > 0 or not self.retry_max_s >= 0.1:
            raise ValueError(f"timeout_s={self.timeout_s} must be > 0 and "
                             f"retry_max_s={self.retry_max_s} >= 0.1")
        if (self.username is None) != (self.password is None):
            raise ValueError("username and password: give both or neither")

    def grpc_options(self) -> dict:
        cap_ms = int(self.retry_max_s * 1000)
        return {"grpc.initial_reconnect_backoff_ms": min(100, cap_ms),
                "grpc.min_reconnect_backoff_ms": min(100, cap_ms),
                "grpc.max_reconnect_backoff_ms": cap_ms,
                "grpc.keepalive_time_ms": 10_000, "grpc.keepalive_timeout_ms": 5_000}


async def store_call(awaitable):
    """Await one etcd RPC, turning any transport failure into StoreUnavailableError."""
    try:
        return await awaitable
    except STORE_ERRORS as e:
        raise StoreUnavailableError(f"etcd: {type(e).__name__}: {e}") from e


class EtcdCluster:
    """One aetcd client shared by the parts a process needs. Close the parts first."""

    def __init__(self, cfg: EtcdConfig):
        host, port = parse_endpoint(cfg.endpoint)
        self.cfg = cfg
        self.keys = ClusterKeys(cfg.cluster)
        self.client = aetcd.Client(host, port, username=cfg.username, password=cfg.password,
                                   timeout=cfg.timeout_s, options=cfg.grpc_options())

    def membership(self) -> "EtcdMembership":
        return EtcdMembership(self.client, self.keys, self.cfg.retry_max_s)

    def member_view(self, on_change: OnChange | None = None) -> "EtcdMemberView":
        return EtcdMemberView(self.client, self.keys, self.cfg.retry_max_s, on_change)

    def admin_store(self) -> "EtcdAdminStore":
        return EtcdAdminStore(self.client, self.keys)

    def election(self, on_change=None):
        from common.cluster.etcd_election import EtcdLeaderElection
        return EtcdLeaderElection(self.client, self.keys, self.cfg.retry_max_s, on_change)

    async def close(self) -> None:
        await self.client.close()

    async def __aenter__(self) -> "EtcdCluster":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


class EtcdMembership(Membership):
    """The node key on the node's own lease. States: unregistered -> registered (lease_id
    set) -> re-registering (lease expired or put failed) -> registered ... -> closed."""

    def __init__(self, client: aetcd.Client, keys: ClusterKeys, retry_max_s: float = 1.0):
        self._client, self._keys, self._retry_max_s = client, keys, retry_max_s
        self.key = ""
        self._value = b""
        self._ttl = self._granted_ttl = 0
        self._lease_id: int | None = None
        self._dirty = False              # _value not yet written on the current lease
        self._lock = asyncio.Lock()      # one writer at a time, so the last value wins
        self._task: asyncio.Task | None = None
        self.num_registrations = 0

    @property
    def registered(self) -> bool:
        return self._lease_id is not None

    @property
    def lease_id(self) -> int | None:
        return self._lease_id

    async def start(self, role: str, node_id: str, value: bytes, ttl_s: float = DEFAULT_TTL_S) -> None:
        if self._task is not None:
            raise RuntimeError(f"membership {self.key} already started")
        self.key = self._keys.node_key(role, node_id)
        self._ttl = self._granted_ttl = lease_ttl_seconds(ttl_s)
        self._value = bytes(value)
        try:
            await self._register()
        except Exception as e:
            log.warning("%s: not registered yet (%s: %s); retrying in the background",
                        self.key, type(e).__name__, e)
        self._task = asyncio.create_task(self._keepalive(), name=f"membership {self.key}")

    async def _register(self) -> None:
        async with self._lock:
            self._lease_id = None
            lease = await self._client.lease(self._ttl)
            await self._client.put(self.key.encode(), self._value, lease=lease.id)
            self._lease_id, self._granted_ttl, self._dirty = lease.id, lease.ttl, False
            self.num_registrations += 1
        log.info("%s: registered on lease %x (ttl %ss)", self.key, lease.id, lease.ttl)

    async def update(self, value: bytes) -> bool:
        self._value, self._dirty = bytes(value), True
        try:
            async with self._lock:
                if self._dirty and self._lease_id is not None:
                    await self._client.put(self.key.encode(), self._value, lease=self._lease_id)
                    self._dirty = False
        except Exception as e:
            log.debug("%s: update deferred to the keepalive task (%s: %s)", self.key, type(e).__name__, e)
        return not self._dirty

    async def _keepalive(self) -> None:
        backoff = lease_backoff(self._ttl, self._retry_max_s)
        retry_log = RetryLog(log, f"{self.key}: keepalive")
        while True:
            try:
                if self._lease_id is None:
                    await self._register()
                else:
                    reply = await self._client.refresh_lease(self._lease_id)
                    if reply is None or reply.TTL <= 0:
                        log.warning("%s: lease %x expired; registering again", self.key, self._lease_id)
                        await self._register()
                    elif self._dirty:
                        await self.update(self._value)
                backoff.reset()
                retry_log.success()
                delay = refresh_interval(self._granted_ttl)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                delay = backoff.next()
                retry_log.failure(e, delay)
            await asyncio.sleep(delay)

    async def abandon(self) -> None:
        """Stop refreshing without revoking: what a crashed process leaves behind (tests)."""
        await cancel_task(self._task)

    async def close(self) -> None:
        task, self._task = self._task, None
        await cancel_task(task)
        lease_id, self._lease_id = self._lease_id, None
        if lease_id is None:
            return
        try:
            await self._client.revoke_lease(lease_id)   # deletes the key with it
        except Exception as e:
            log.warning("%s: could not revoke lease %x (%s); the key goes within the TTL",
                        self.key, lease_id, e)


class EtcdMemberView(MemberView):
    """Lists /pdmesh/<cluster>/nodes/, then watches it from the next revision. States:
    listing -> watching -> (broken: backoff, re-watch from revision + 1 | compacted:
    re-list) -> watching ... -> closed. members() is never cleared by a failure."""

    def __init__(self, client: aetcd.Client, keys: ClusterKeys, retry_max_s: float = 1.0,
                 on_change: OnChange | None = None):
        super().__init__(on_change)
        self._client, self._keys, self._retry_max_s = client, keys, retry_max_s
        self._prefix = keys.nodes_prefix.encode()
        self.revision: int | None = None   # every change up to it is in members()
        self.num_lists = 0                 # 1 after start; more after compactions
        self.num_watches = 0
        self._task: asyncio.Task | None = None
        self._watch = None

    async def start(self) -> None:
        if self._task is not None:
            raise RuntimeError("member view already started")
        try:
            await self._list()
        except Exception as e:
            log.warning("member view: first list failed (%s: %s); retrying", type(e).__name__, e)
        self._task = asyncio.create_task(self._follow(), name="member view")

    async def _list(self) -> None:
        result = await self._client.get_prefix(self._prefix)
        new = {}
        for kv in result:
            member = self._keys.parse_node_key(kv.key)
            if member is not None:
                new[member] = kv.value
        self._replace_all(new)
        self.revision = result.header.revision
        self.num_lists += 1

    async def _follow(self) -> None:
        backoff = Backoff(0.1, self._retry_max_s)
        retry_log = RetryLog(log, "member view: watch (serving the last known view)")
        while True:
            try:
                if self.revision is None:
                    await self._list()
                self._watch = await self._client.watch_prefix(self._prefix, start_revision=self.revision + 1)
                self.num_watches += 1
                backoff.reset()
                retry_log.success()
                async for event in self._watch:
                    self._apply(event)
            except aetcd.RevisionCompactedError as e:
                log.info("member view: revision %s compacted (%s); listing again", self.revision, e)
                self.revision = None
            except asyncio.CancelledError:
                raise
            except Exception as e:
                delay = backoff.next()
                retry_log.failure(e, delay)
                await asyncio.sleep(delay)

    def _apply(self, event: aetcd.Event) -> None:
        self.revision = max(self.revision or 0, event.kv.mod_revision)
        member = self._keys.parse_node_key(event.kv.key)
        if member is None:
            return
        if event.kind == aetcd.EventKind.PUT:
            self._set(member, event.kv.value)
        else:
            self._remove(member)

    async def close(self) -> None:
        task, self._task = self._task, None
        await cancel_task(task)
        watch, self._watch = self._watch, None
        if watch is not None:
            try:
                await watch.cancel()
            except Exception:
                pass


class EtcdAdminStore(AdminStore):
    """Plain keys (no lease) under /pdmesh/<cluster>/admin/; every call is one RPC."""

    def __init__(self, client: aetcd.Client, keys: ClusterKeys):
        self._client, self._keys = client, keys

    async def get(self, name: str) -> bytes | None:
        result = await store_call(self._client.get(self._keys.admin_key(name).encode()))
        return None if result is None else result.value

    async def put(self, name: str, value: bytes) -> None:
        await store_call(self._client.put(self._keys.admin_key(name).encode(), bytes(value)))

    async def delete(self, name: str) -> bool:
        result = await store_call(self._client.delete(self._keys.admin_key(name).encode()))
        return result is not None

    async def list(self, prefix: str = "") -> dict[str, bytes]:
        root = self._keys.admin_prefix
        result = await store_call(self._client.get_prefix((root + prefix).encode()))
        return {kv.key.decode()[len(root):]: kv.value for kv in result}
