"""Cluster membership: the ABCs every backend implements, key layout, shared pure logic.

Values are opaque bytes (the services store a serialized NodeInfo); this layer knows
nothing about pdmesh messages. Key layout in the store, one tree per cluster name:

    /pdmesh/<cluster>/nodes/<role>/<node_id>   -> value, bound to the node's lease
    /pdmesh/<cluster>/admin/<name>             -> value, no lease (drained nodes, policy)
    /pdmesh/<cluster>/leader                   -> candidate id, bound to the leader's lease

Lifecycles (each object belongs to one event loop; none is thread-safe):

  Membership (a node):   start -> registered <-> re-registering -> close
      start puts the key on a fresh lease and refreshes it every TTL/3 in its own task;
      when the store goes away or the lease expired meanwhile, the task re-grants a
      lease and puts the key again by itself. The task never raises (it logs).
  MemberView (meta-server): start (list, then watch from the next revision) -> watching
      <-> retrying (backoff; re-watch from last revision + 1, re-list if compacted) -> close
      members() is the last known view and is served unchanged while the store is down.
  LeaderElection:        campaign -> standby <-> leader -> resign
      the leader key is created on the candidate's own lease only if absent (one
      transaction); a standby keeps its lease alive and takes over when the key goes.
      The services run it on election_ttl_seconds(membership TTL), so that a standby
      leads within one membership TTL of the leader's death.
  AdminStore:            plain get/put/delete/list; raises StoreUnavailableError when down.
"""
from __future__ import annotations

import abc
import enum
import logging
import random
import re
import time
from dataclasses import dataclass, field
from typing import Callable

log = logging.getLogger(__name__)

ROOT = "/pdmesh"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")
DEFAULT_TTL_S = 5.0


class StoreUnavailableError(RuntimeError):
    """The store cannot be reached now (an RPC failed or timed out); retry later."""


def check_name(kind: str, name: str) -> str:
    """A path segment: letters, digits, '.', '_', ':', '-', not starting with a symbol."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"{kind} {name!r}: use letters, digits, '.', '_', ':' or '-' "
                         "(no '/', not empty, starting with a letter or digit)")
    return name


@dataclass(frozen=True)
class ClusterKeys:
    """Every key this layer reads or writes, for one cluster name."""
    cluster: str

    def __post_init__(self):
        check_name("cluster", self.cluster)

    @property
    def root(self) -> str:
        return f"{ROOT}/{self.cluster}/"

    @property
    def nodes_prefix(self) -> str:
        return self.root + "nodes/"

    @property
    def admin_prefix(self) -> str:
        return self.root + "admin/"

    @property
    def leader_key(self) -> str:
        return self.root + "leader"

    def node_key(self, role: str, node_id: str) -> str:
        return f"{self.nodes_prefix}{check_name('role', role)}/{check_name('node_id', node_id)}"

    def parse_node_key(self, key: str | bytes) -> tuple[str, str] | None:
        """(role, node_id) for a well-formed node key of this cluster, else None."""
        if isinstance(key, bytes):
            key = key.decode("utf-8", "replace")
        if not key.startswith(self.nodes_prefix):
            return None
        parts = key[len(self.nodes_prefix):].split("/")
        if len(parts) != 2 or not all(_NAME.match(p) for p in parts):
            return None
        return parts[0], parts[1]

    def admin_key(self, name: str) -> str:
        """`name` may hold '/'-separated segments ("drained/decode-0")."""
        if not name or name.startswith("/") or name.endswith("/") or "//" in name:
            raise ValueError(f"admin key {name!r}: non-empty '/'-separated segments, "
                             "no leading, trailing or doubled '/'")
        return self.admin_prefix + name


def lease_ttl_seconds(ttl_s: float) -> int:
    """etcd leases count whole seconds: round up, at least 1."""
    if not ttl_s > 0:
        raise ValueError(f"ttl_s {ttl_s!r}: must be > 0 seconds")
    return max(1, int(-(-ttl_s // 1)))


ETCD_EXPIRY_CHECK_S = 0.5    # etcd revokes expired leases in a sweep this often


def election_ttl_seconds(member_ttl_s: float) -> int:
    """The leader lease TTL for meta-servers whose nodes live on `member_ttl_s` leases:
    half of it in whole seconds, at least 1.

    A standby leads at most lease TTL + ETCD_EXPIRY_CHECK_S (+ one watch event and one
    transaction, milliseconds) after the leader's last refresh, so with half the TTL it
    leads within the membership TTL, at least 0.5 s early, for member_ttl_s >= 2
    (TTL 2 -> lease 1: leads within 1.5 s; 3 -> 1: 1.5 s; 5 -> 2: 2.5 s). Below 2 s no
    lease is short enough (etcd counts whole seconds). etcd grants at least its minimum
    TTL (1.5 election timeouts: 2 s with its defaults), which then sets the bound.
    """
    lease_ttl_seconds(member_ttl_s)    # validates
    return max(1, int(member_ttl_s // 2))


def refresh_interval(granted_ttl_s: float) -> float:
    """Keepalive period: a third of the TTL, so two refreshes may fail before expiry."""
    return granted_ttl_s / 3.0


@dataclass
class Backoff:
    """Exponential retry delays with full-range jitter in [delay/2, delay].

    next() -> initial, initial*factor, ... capped at max_s; reset() after a success.
    """
    initial_s: float = 0.1
    max_s: float = 2.0
    factor: float = 2.0
    rng: random.Random = field(default_factory=random.Random)
    _attempt: int = 0

    def __post_init__(self):
        if not (0 < self.initial_s <= self.max_s) or self.factor < 1:
            raise ValueError(f"Backoff(initial_s={self.initial_s}, max_s={self.max_s}, "
                             f"factor={self.factor}): need 0 < initial_s <= max_s, factor >= 1")

    def peek(self) -> float:
        return min(self.max_s, self.initial_s * self.factor ** self._attempt)

    def next(self) -> float:
        delay = self.peek()
        self._attempt += 1
        return delay * (0.5 + 0.5 * self.rng.random())

    def reset(self) -> None:
        self._attempt = 0


def lease_backoff(ttl_s: float, retry_max_s: float) -> Backoff:
    """Retry delays for a lease owner: capped at retry_max_s and at the refresh interval,
    so that after an outage the lease is refreshed again before it can lapse."""
    return Backoff(0.1, max(0.1, min(retry_max_s, refresh_interval(ttl_s))))


class RetryLog:
    """A retry loop's log: the first failure as a warning, the next ones at debug level,
    then one info line on recovery (no flood while the store is down for minutes)."""

    def __init__(self, logger: logging.Logger, what: str):
        self._log, self.what = logger, what
        self.num_failures = 0
        self._since = 0.0

    def failure(self, error: BaseException, delay_s: float) -> None:
        self.num_failures += 1
        level = logging.WARNING if self.num_failures == 1 else logging.DEBUG
        if self.num_failures == 1:
            self._since = time.monotonic()
        self._log.log(level, "%s: %s: %s; retry in %.2fs", self.what, type(error).__name__, error, delay_s)

    def success(self) -> None:
        if self.num_failures:
            self._log.info("%s: recovered after %d failed tries in %.1fs", self.what,
                           self.num_failures, time.monotonic() - self._since)
            self.num_failures = 0


class ChangeKind(enum.Enum):
    ADDED = "added"
    UPDATED = "updated"        # put again, maybe with the same value (the owner refreshed it)
    REMOVED = "removed"


@dataclass(frozen=True)
class MemberChange:
    kind: ChangeKind
    role: str
    node_id: str
    value: bytes | None        # the new value; the last known one for REMOVED


MemberKey = tuple[str, str]    # (role, node_id)
OnChange = Callable[[MemberChange], None]


def diff_members(old: dict[MemberKey, bytes], new: dict[MemberKey, bytes]) -> list[MemberChange]:
    """Changes that turn `old` into `new`, removals first, each group in key order."""
    changes = [MemberChange(ChangeKind.REMOVED, r, n, old[(r, n)]) for r, n in sorted(old.keys() - new.keys())]
    for key in sorted(new):
        if key not in old:
            changes.append(MemberChange(ChangeKind.ADDED, *key, new[key]))
        elif old[key] != new[key]:
            changes.append(MemberChange(ChangeKind.UPDATED, *key, new[key]))
    return changes


class Membership(abc.ABC):
    """A node's own registration. start -> (update)* -> close; see the module lifecycle."""

    @abc.abstractmethod
    async def start(self, role: str, node_id: str, value: bytes, ttl_s: float = DEFAULT_TTL_S) -> None:
        """Register and keep registered until close(). Raises ValueError on a bad name or
        TTL; never raises because the store is down (it logs and keeps retrying)."""

    @abc.abstractmethod
    async def update(self, value: bytes) -> bool:
        """Make `value` the current one. True if written now; False if it will be written
        when the store is reachable again (never raises for a down store; waits at most
        one RPC timeout)."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop refreshing and remove the key (revokes the lease); best effort, idempotent."""

    @property
    @abc.abstractmethod
    def registered(self) -> bool:
        """True while the key is believed to be in the store on a live lease."""


class MemberView(abc.ABC):
    """The meta-server's view of every node. Subclasses feed it through _replace_all,
    _set and _remove; it keeps the dict and calls `on_change` (on the event loop; it must
    not block; an exception in it is logged and dropped)."""

    def __init__(self, on_change: OnChange | None = None):
        self._members: dict[MemberKey, bytes] = {}
        self._on_change = on_change

    @abc.abstractmethod
    async def start(self) -> None:
        """List the members, then follow changes in the background until close(). Never
        raises because the store is down: the view starts empty and fills on reconnect."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop following; members() keeps the last known view. Idempotent."""

    def members(self) -> dict[MemberKey, bytes]:
        """A copy of the last known view: {(role, node_id): value}."""
        return dict(self._members)

    def _emit(self, changes: list[MemberChange]) -> None:
        if self._on_change is None:
            return
        for change in changes:
            try:
                self._on_change(change)
            except Exception:
                log.exception("member view on_change callback failed for %s", change)

    def _replace_all(self, new: dict[MemberKey, bytes]) -> None:
        changes = diff_members(self._members, new)
        self._members = dict(new)
        self._emit(changes)

    def _set(self, key: MemberKey, value: bytes) -> None:
        """A put: ADDED for a new key, else UPDATED even when the value is unchanged (a
        member that puts its key again is reporting that it is alive)."""
        old = self._members.get(key)
        self._members[key] = value
        kind = ChangeKind.ADDED if old is None else ChangeKind.UPDATED
        self._emit([MemberChange(kind, key[0], key[1], value)])

    def _remove(self, key: MemberKey) -> None:
        old = self._members.pop(key, None)
        if old is not None:
            self._emit([MemberChange(ChangeKind.REMOVED, key[0], key[1], old)])


class AdminStore(abc.ABC):
    """Durable admin state under /pdmesh/<cluster>/admin/. Every call may raise
    StoreUnavailableError; names are validated by ClusterKeys.admin_key (ValueError)."""

    @abc.abstractmethod
    async def get(self, name: str) -> bytes | None: ...

    @abc.abstractmethod
    async def put(self, name: str, value: bytes) -> None: ...

    @abc.abstractmethod
    async def delete(self, name: str) -> bool:
        """True if the key existed."""

    @abc.abstractmethod
    async def list(self, prefix: str = "") -> dict[str, bytes]:
        """{name: value} for every admin name starting with `prefix` ("drained/")."""


class LeaderElection(abc.ABC):
    """One candidate. campaign -> (standby <-> leader)* -> resign. `on_change(is_leader)`
    is called on the event loop whenever leadership is gained or lost."""

    def __init__(self, on_change: Callable[[bool], None] | None = None):
        self._on_change = on_change

    @abc.abstractmethod
    async def campaign(self, candidate_id: str, ttl_s: float = DEFAULT_TTL_S) -> None:
        """Try once now (so is_leader is current on return when the store is up), then keep
        campaigning and keep the lease alive in the background until resign()."""

    @property
    @abc.abstractmethod
    def is_leader(self) -> bool:
        """True only while this candidate holds the key on a lease known to be alive: a
        leader that cannot refresh its lease stops claiming it before the lease can expire."""

    @property
    def was_leader(self) -> bool:
        """True while this candidate led at its last contact with the store and every
        call since has failed: it may go on acting on its last view, so that a store
        outage stops nothing (availability over exclusivity; see etcd_election.py).
        Optional: is_leader by default."""
        return self.is_leader

    @abc.abstractmethod
    async def leader(self) -> str | None:
        """The current leader's candidate id read from the store, or None. May raise
        StoreUnavailableError."""

    @abc.abstractmethod
    async def wait_leader(self, timeout_s: float | None = None) -> bool:
        """Wait until this candidate leads; False on timeout."""

    @abc.abstractmethod
    async def resign(self) -> None:
        """Stop campaigning and give the key up at once (revokes the lease). Idempotent."""

    def _notify(self, leading: bool) -> None:
        if self._on_change is None:
            return
        try:
            self._on_change(leading)
        except Exception:
            log.exception("leader election on_change callback failed")
