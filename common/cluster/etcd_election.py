"""Leader election over etcd: one key, /pdmesh/<cluster>/leader = candidate id, on the
leader's own lease.

Lifecycle of one candidate (its own task after campaign()):

    grant lease -> try acquire: txn(create_revision(key) == 0 ? put(key, id, lease) : get(key))
        won, or the key is already on our lease -> LEADER: refresh the lease every TTL/3
        else -> STANDBY: refresh the lease every TTL/3 and, in between, watch the key from
                the txn's revision + 1; a DELETE (revoke or expiry) -> try acquire at once
    refresh says the lease is gone (TTL 0) -> step down, grant a new lease, try again
    store unreachable -> retry with backoff; is_leader turns False by itself when the last
        confirmed lease deadline passes, before the lease can expire on the server
    resign() -> stop, revoke the lease (the key goes with it; a standby takes over at once)

Takeover: a standby leads when the leader's lease expires, at most one lease TTL after
the leader's last refresh, plus etcd's expiry sweep (ETCD_EXPIRY_CHECK_S) and one watch
event. Meta-servers campaign with election_ttl_seconds(membership TTL), half of it, so
a standby leads within one membership TTL after the leader is killed.

Safety, at most one leader acts: (1) is_leader holds only until `sent + TTL`, where
`sent` is when this candidate sent the last grant or refresh that etcd confirmed; etcd
received it later, so the lease lives at least that long (both clocks are monotonic; their
drift over one TTL is negligible). (2) A standby leads only through the create-if-absent
transaction, which succeeds only once etcd deleted the key, i.e. once that lease expired
or was revoked, so after the old leader's is_leader has turned False. (3) A leader whose
deadline passed without any failed call (a stalled process, a slow reply) is neither
is_leader nor was_leader until etcd answers, so it does not act on a lost lead either.
The one trade of safety for availability is was_leader: a leader that cannot reach etcd
at all goes on acting on its last view, so that an etcd outage stops nothing (no standby
can be elected meanwhile). If instead only this leader is cut off while a standby still
reaches etcd (a partition), both act until this one reaches etcd again and steps down;
for routing that costs balance, not correctness, and admin changes need etcd anyway.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import aetcd

from common.cluster.base import (DEFAULT_TTL_S, ClusterKeys, LeaderElection, RetryLog, check_name,
                                 lease_backoff, lease_ttl_seconds, refresh_interval)
from common.cluster.etcd import store_call
from common.tasks import cancel_task

log = logging.getLogger(__name__)


class EtcdLeaderElection(LeaderElection):
    def __init__(self, client: aetcd.Client, keys: ClusterKeys, retry_max_s: float = 1.0,
                 on_change: Callable[[bool], None] | None = None):
        super().__init__(on_change)
        self._client, self._keys, self._retry_max_s = client, keys, retry_max_s
        self._key = keys.leader_key.encode()
        self.candidate_id = ""
        self._ttl = 0
        self._lease_id: int | None = None
        self._lease_deadline = 0.0       # monotonic time before which the lease surely lives
        self._next_refresh = 0.0
        self._leading = False
        self._unreachable = False        # a call failed since etcd last answered
        self._task: asyncio.Task | None = None

    @property
    def is_leader(self) -> bool:
        return self._leading and time.monotonic() < self._lease_deadline

    @property
    def was_leader(self) -> bool:
        """Led at the last contact with etcd, and every call since has failed: etcd is
        unreachable from here (see the module's safety note). False again as soon as
        etcd answers (then is_leader says whether we still lead)."""
        return self._leading and self._unreachable

    async def campaign(self, candidate_id: str, ttl_s: float = DEFAULT_TTL_S) -> None:
        if self._task is not None:
            raise RuntimeError(f"{self.candidate_id} is already campaigning")
        self.candidate_id = check_name("candidate_id", candidate_id)
        self._ttl = lease_ttl_seconds(ttl_s)
        try:
            await self._grant()
            await self._try_acquire()
        except Exception as e:
            log.warning("election %s: first try failed (%s: %s); retrying", candidate_id, type(e).__name__, e)
        self._task = asyncio.create_task(self._run(), name=f"election {candidate_id}")

    async def leader(self) -> str | None:
        result = await store_call(self._client.get(self._key))
        return None if result is None else result.value.decode()

    async def wait_leader(self, timeout_s: float | None = None) -> bool:
        """Polls is_leader (it also turns True when a refresh confirms the lease again,
        which no leadership change announces)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self.is_leader:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.01)
        return True

    def _set_leading(self, leading: bool) -> None:
        if leading == self._leading:
            return
        self._leading = leading
        log.info("election %s: %s", self.candidate_id, "leader" if leading else "standby")
        self._notify(leading)

    def _confirmed(self, sent: float, ttl: int) -> None:
        self._unreachable = False
        self._lease_deadline = sent + ttl
        self._next_refresh = sent + refresh_interval(ttl)

    async def _grant(self) -> None:
        sent = time.monotonic()
        lease = await self._client.lease(self._ttl)
        self._lease_id = lease.id
        self._confirmed(sent, lease.ttl)

    async def _refresh(self) -> bool:
        sent = time.monotonic()
        reply = await self._client.refresh_lease(self._lease_id)
        if reply is None or reply.TTL <= 0:
            log.warning("election %s: lease %x expired", self.candidate_id, self._lease_id)
            self._lease_id = None
            self._set_leading(False)
            return False
        self._confirmed(sent, reply.TTL)
        return True

    async def _try_acquire(self) -> int:
        """Lead if the key is absent or already on our lease (returns 0); else the store
        revision at which another candidate held it."""
        tx = self._client.transactions
        won, responses = await self._client.transaction(
            compare=[tx.create(self._key) == 0],
            success=[tx.put(self._key, self.candidate_id.encode(), lease=self._lease_id)],
            failure=[tx.get(self._key)])
        self._unreachable = False
        holder = None if won or not responses or not responses[0] else responses[0][0][1]
        if won or (holder is not None and holder.lease == self._lease_id):
            self._set_leading(True)
            return 0
        self._set_leading(False)
        return holder.header.revision if holder is not None else 0

    async def _wait_vacant(self, revision: int, until: float) -> None:
        """Return when the leader key is deleted after `revision`, or at `until`."""
        watch = await self._client.watch(self._key, start_revision=revision + 1)

        async def deleted():
            async for event in watch:
                if event.kind == aetcd.EventKind.DELETE:
                    return

        try:
            await asyncio.wait_for(deleted(), max(0.0, until - time.monotonic()))
        except asyncio.TimeoutError:
            pass
        finally:
            try:
                await watch.cancel()
            except Exception:
                pass

    async def _run(self) -> None:
        backoff = lease_backoff(self._ttl, self._retry_max_s)
        retry_log = RetryLog(log, f"election {self.candidate_id}")
        while True:
            try:
                if self._lease_id is None:
                    await self._grant()
                elif time.monotonic() >= self._next_refresh and not await self._refresh():
                    continue
                if not self._leading:
                    revision = await self._try_acquire()
                    if revision:
                        await self._wait_vacant(revision, self._next_refresh)
                        continue
                backoff.reset()
                retry_log.success()
                await asyncio.sleep(max(0.0, self._next_refresh - time.monotonic()))
            except asyncio.CancelledError:
                raise
            except Exception as e:
                # is_leader turns False by itself at the lease deadline; was_leader holds
                # until etcd answers again (then _refresh or _try_acquire settles it).
                self._unreachable = True
                delay = backoff.next()
                if self.is_leader:
                    delay = min(delay, max(0.01, self._lease_deadline - time.monotonic()))
                retry_log.failure(e, delay)
                await asyncio.sleep(delay)

    async def abandon(self) -> None:
        """Stop refreshing without revoking: what a crashed leader leaves behind (tests)."""
        await cancel_task(self._task)

    async def resign(self) -> None:
        task, self._task = self._task, None
        await cancel_task(task)
        lease_id, self._lease_id = self._lease_id, None
        self._set_leading(False)
        if lease_id is not None:
            try:
                await self._client.revoke_lease(lease_id)
            except Exception as e:
                log.warning("election %s: could not revoke lease %x (%s); it expires within the TTL",
                            self.candidate_id, lease_id, e)
