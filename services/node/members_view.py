"""What a service knows of the mesh's live members: the meta-server's ListMembers, cached
briefly. A prefill node checks a KV destination against it (services/prefill/
destination_check.py); the kv-store makes key spaces only for what members serve.

    view = MembersView.for_mesh(mesh)          # or MembersView(source) with any source
    member = await view.find(accept)           # a live member with accept(member), or None
    view.last()                                # the list find() answered from (to explain a miss)
    await view.close()

Bounds (all from the membership TTL in for_mesh):
  max_age_s      a list is used for at most this long after its fetch began; then the
                 next find() fetches again first. So a member that left is accepted at
                 most max_age_s after the meta-server dropped it (which itself takes up
                 to one TTL after its last heartbeat).
  miss           no member of a young-enough list is accepted: find() waits for a list
                 whose fetch began after the call did, and answers from it. So a member
                 that registered before the call (a decode node that was just routed
                 to) is found, never refused from a stale list.
  refresh ahead  a hit on a list older than max_age_s / 2 starts a fetch in the background
                 (not awaited): under steady traffic the list is renewed before it
                 expires, so no request waits for ListMembers on its path.
  keep fresh     (keep_fresh=True; for_mesh's views) while lookups came within the last
                 keep_fresh_s, a background task renews the list every max_age_s / 2,
                 so that sparse traffic (requests further apart than max_age_s) does not
                 wait for a fetch either: at 1 request/s and the default TTL of 5 s, one
                 Prefill in five did, a gRPC round trip on its path to the first token.
  single flight  one ListMembers at a time per view, at least min_interval_s apart,
                 shared by every caller waiting for it: a flood of misses (forged
                 requests) costs the meta-server at most 1/min_interval_s calls a second.
  meta-server away  a fetch that fails leaves the last list in use while it is at most
                 max_stale_s old (hits only; a member it lacks cannot be vouched for);
                 beyond that find() raises MembersUnavailable.
The list holds whatever the meta-server answered (one NodeInfo per live member).

Thread-safety: event loop only.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

import grpc

from protos.pdmesh.v1 import common_pb2, meta_pb2, meta_pb2_grpc
from services.node import grpc_util

log = logging.getLogger("pdmesh.members")

MembersSource = Callable[[], Awaitable[Sequence[common_pb2.NodeInfo]]]
MIN_INTERVAL_S = 0.05
KEEP_FRESH_S = 60.0   # by default a list is kept fresh this long after the last lookup


class MembersUnavailable(RuntimeError):
    """No list of members recent enough to answer from, and the meta-server cannot be asked."""


class MembersView:
    def __init__(self, source: MembersSource, max_age_s: float, max_stale_s: float,
                 min_interval_s: float = MIN_INTERVAL_S, fetch_timeout_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic, close: Callable[[], Awaitable[None]] | None = None,
                 keep_fresh: bool = False, keep_fresh_s: float = KEEP_FRESH_S):
        """source: returns the live members now (raises when it cannot); close: releases it;
        keep_fresh: renew the list in the background while lookups came within the last
        keep_fresh_s (module doc)."""
        if not 0 < max_age_s <= max_stale_s:
            raise ValueError(f"need 0 < max_age_s <= max_stale_s, got {max_age_s}, {max_stale_s}")
        self.source, self.clock = source, clock
        self.max_age_s, self.max_stale_s = max_age_s, max_stale_s
        self.min_interval_s, self.fetch_timeout_s = min_interval_s, fetch_timeout_s
        self._close = close
        self._members: tuple[common_pb2.NodeInfo, ...] = ()
        self._fetched_at = float("-inf")    # when the fetch of _members began
        self._fetch: tuple[asyncio.Task, float] | None = None
        self._last_start = float("-inf")
        self.num_fetches = 0
        self.keep_fresh, self.keep_fresh_s = keep_fresh, keep_fresh_s
        self._last_find = float("-inf")
        self._keeper: asyncio.Task | None = None
        self._closed = False

    @classmethod
    def for_mesh(cls, mesh, credentials=None) -> "MembersView":
        """The view of mesh's meta-servers (gateway.meta_addresses, else meta.address),
        each call with this process's mesh identity (or `credentials`)."""
        addresses = list(mesh.gateway.meta_addresses) or [mesh.meta.address]
        ttl = mesh.meta.ttl_seconds
        source = MetaMembers(addresses, timeout_s=min(ttl, 5.0), credentials=credentials)
        return cls(source, max_age_s=ttl / 3, max_stale_s=ttl, fetch_timeout_s=min(ttl, 5.0), close=source.close,
                   keep_fresh=True)

    @classmethod
    def static(cls, members: Sequence[common_pb2.NodeInfo]) -> "MembersView":
        """A view whose source always answers `members` (in-process tests without a
        meta-server; the list object is read at each fetch, so a test may change it)."""
        async def source():
            return members
        return cls(source, max_age_s=60.0, max_stale_s=60.0)

    def last(self) -> tuple[common_pb2.NodeInfo, ...]:
        return self._members

    async def find(self, accept: Callable[[common_pb2.NodeInfo], bool]) -> common_pb2.NodeInfo | None:
        """A live member for which accept(member) holds, else None (see the module doc for
        which list answers). Raises MembersUnavailable."""
        since = self._last_find = self.clock()
        if self.keep_fresh and self._keeper is None and not self._closed:
            self._keeper = asyncio.get_running_loop().create_task(self._keep_fresh())
            self._keeper.add_done_callback(_retrieve)
        age = since - self._fetched_at
        if age <= self.max_age_s:
            member = self._match(accept)
            if member is not None:
                if age > self.max_age_s / 2:
                    self._refresh_ahead(since)
                return member
        try:
            await asyncio.wait_for(self._fetched_since(since), self.fetch_timeout_s)
        except Exception as e:   # the source's failure (gRPC error, timeout): fall back to the last list
            if self.clock() - self._fetched_at <= self.max_stale_s:
                member = self._match(accept)
                if member is not None:
                    log.warning("members: fetch failed (%s); answering from a list %.1fs old",
                                _describe(e), self.clock() - self._fetched_at)
                    return member
            raise MembersUnavailable(f"cannot list the mesh's members: {_describe(e)}") from e
        return self._match(accept)

    def _match(self, accept) -> common_pb2.NodeInfo | None:
        return next((m for m in self._members if accept(m)), None)

    async def _fetched_since(self, since: float) -> None:
        """Returns once a fetch that began at or after `since` has succeeded; raises its error."""
        while True:
            if self._fetch is not None:
                task, started = self._fetch
                if started >= since:
                    await asyncio.shield(task)
                    return
                if not task.done():
                    await asyncio.wait([task])
                    continue
            delay = self._last_start + self.min_interval_s - self.clock()
            if delay > 0:
                await asyncio.sleep(delay)
                continue                          # another caller may have started one meanwhile
            self._start_fetch()

    async def _keep_fresh(self) -> None:
        """Renew the list once it is max_age_s / 2 old, until lookups stop for
        keep_fresh_s (the next find() starts it again) or the view closes."""
        try:
            while not self._closed and self.clock() - self._last_find <= self.keep_fresh_s:
                # half a max age after the last fetch began (a failing one too: at most
                # one every max_age_s / 2 while the meta-server is away)
                due = max(self._fetched_at, self._last_start) + self.max_age_s / 2 - self.clock()
                await asyncio.sleep(max(due, self.min_interval_s, 0.001))
                now = self.clock()
                if not self._closed and now - self._fetched_at >= self.max_age_s / 2:
                    self._refresh_ahead(now)
        finally:
            self._keeper = None

    def _refresh_ahead(self, now: float) -> None:
        """Start a fetch nobody waits for, unless one is in flight or the last began less
        than min_interval_s ago."""
        if self._fetch is not None and not self._fetch[0].done():
            return
        if now - self._last_start >= self.min_interval_s:
            self._start_fetch()

    def _start_fetch(self) -> None:
        started = self._last_start = self.clock()
        task = asyncio.get_running_loop().create_task(self._run_fetch(started))
        task.add_done_callback(_retrieve)     # its waiters may all have timed out
        self._fetch = (task, started)

    async def _run_fetch(self, started: float) -> None:
        members = tuple(await self.source())
        self.num_fetches += 1
        if started >= self._fetched_at:
            self._members, self._fetched_at = members, started

    async def close(self) -> None:
        self._closed = True
        if self._keeper is not None:
            self._keeper.cancel()
            await asyncio.gather(self._keeper, return_exceptions=True)
        if self._fetch is not None and not self._fetch[0].done():
            self._fetch[0].cancel()
            await asyncio.gather(self._fetch[0], return_exceptions=True)
        if self._close is not None:
            await self._close()


class MetaMembers:
    """ListMembers on the first of `addresses` that answers (a meta-server that is away,
    or a standby that refuses, passes the call on to the next one)."""

    def __init__(self, addresses: list[str], timeout_s: float = 5.0, credentials=None):
        if not addresses:
            raise ValueError("at least one meta-server address is required")
        self.addresses, self.timeout_s = list(addresses), timeout_s
        self._channels = [grpc_util.channel(a) if credentials is None else grpc_util.channel(a, credentials)
                          for a in self.addresses]
        self._stubs = [meta_pb2_grpc.MetaServerStub(ch) for ch in self._channels]
        self._current = 0

    async def __call__(self) -> list[common_pb2.NodeInfo]:
        for attempt in range(len(self._stubs)):
            try:
                reply = await self._stubs[self._current].ListMembers(meta_pb2.ListMembersRequest(),
                                                                     timeout=self.timeout_s)
                return list(reply.nodes)
            except grpc.aio.AioRpcError as e:
                if attempt == len(self._stubs) - 1 or e.code() not in _FOLLOW:
                    raise
                self._current = (self._current + 1) % len(self._stubs)
        raise AssertionError("unreachable")

    async def close(self) -> None:
        for ch in self._channels:
            await ch.close()


_FOLLOW = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.DEADLINE_EXCEEDED)


def _retrieve(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()


def _describe(error: BaseException) -> str:
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name} {error.details()}"
    if isinstance(error, asyncio.TimeoutError):
        return "the meta-server did not answer in time"
    return f"{type(error).__name__}: {error}"
