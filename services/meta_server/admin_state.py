"""Operator state of the meta-server: the routing policy and the drained node ids.

It outlives requests and, with a store behind it (etcd), a meta-server restart: a new
meta-server calls `load()` and routes as the old one did. Reads are synchronous and come
from the current view, because Route reads them on every request; writes are async so
a store-backed implementation persists before the admin RPC returns (and updates its
view from its watch when another meta-server writes).

Implementations: InMemoryAdminState (the embedded default, lost on restart) and
StoreAdminState (over a common.cluster AdminStore, e.g. etcd: keys `policy` and
`drained/<node_id>` under /pdmesh/<cluster>/admin/). Validation (known policy, known
node) is the caller's job; this only stores. A write the store cannot take raises
AdminStateUnavailableError and leaves the view unchanged.
Thread-safety: event loop only.
"""
from __future__ import annotations

from abc import ABC, abstractmethod


class AdminStateUnavailableError(RuntimeError):
    """The store behind the admin state cannot be reached now; nothing was changed."""


class AdminState(ABC):
    async def load(self) -> None:
        """Recover the view from the store at start-up. Optional: no-op by default."""

    async def close(self) -> None:
        """Release the store. Optional: no-op by default."""

    @abstractmethod
    def policy(self) -> str:
        """The routing policy in force."""

    @abstractmethod
    def drained_node_ids(self) -> frozenset[str]:
        """Node ids that get no new requests."""

    @abstractmethod
    async def set_policy(self, policy: str) -> None:
        """Persist and apply a (validated) policy name."""

    @abstractmethod
    async def set_drained(self, node_id: str, drained: bool) -> None:
        """Persist and apply the drained flag of a node; idempotent."""


class InMemoryAdminState(AdminState):
    def __init__(self, policy: str, drained_node_ids: frozenset[str] = frozenset()):
        self._policy = policy
        self._drained = frozenset(drained_node_ids)

    def policy(self) -> str:
        return self._policy

    def drained_node_ids(self) -> frozenset[str]:
        return self._drained

    async def set_policy(self, policy: str) -> None:
        self._policy = policy

    async def set_drained(self, node_id: str, drained: bool) -> None:
        self._drained = self._drained | {node_id} if drained else self._drained - {node_id}


class StoreAdminState(AdminState):
    """Admin state persisted in an AdminStore (async get/put/delete/list of bytes, which
    raises a RuntimeError such as StoreUnavailableError when the store is down).
    load() reads the store into the view (call it at start and on becoming leader);
    until then the view is `default_policy` and nothing drained."""

    POLICY, DRAINED = "policy", "drained/"

    def __init__(self, store, default_policy: str):
        self.store = store
        self._view = InMemoryAdminState(default_policy)

    async def _call(self, method: str, *args):
        try:
            return await getattr(self.store, method)(*args)
        except RuntimeError as e:
            raise AdminStateUnavailableError(f"admin store unavailable: {e}") from e

    async def load(self) -> None:
        policy = await self._call("get", self.POLICY)
        drained = await self._call("list", self.DRAINED)
        self._view = InMemoryAdminState(policy.decode() if policy else self._view.policy(),
                                        frozenset(k.removeprefix(self.DRAINED) for k in drained))

    def policy(self) -> str:
        return self._view.policy()

    def drained_node_ids(self) -> frozenset[str]:
        return self._view.drained_node_ids()

    async def set_policy(self, policy: str) -> None:
        await self._call("put", self.POLICY, policy.encode())
        await self._view.set_policy(policy)

    async def set_drained(self, node_id: str, drained: bool) -> None:
        if drained:
            await self._call("put", self.DRAINED + node_id, b"1")
        else:
            await self._call("delete", self.DRAINED + node_id)
        await self._view.set_drained(node_id, drained)
