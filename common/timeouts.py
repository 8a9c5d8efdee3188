"""The request path's timeouts and leases (section `timeouts:` of a mesh config), in one
frozen dataclass whose order is checked at load. common.config re-exports it."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class TimeoutConfig:
    """Every timeout and lease of a request's path (section `timeouts:`), in the order that
    makes "no KV write lands after its blocks were freed" true; checked at load:

        2 x transfer_s < cancel_ack_s < prefill_s < request_s
        2 x transfer_s < kv_store_pin_lease_s,  2 x transfer_s < kv_store_reserve_lease_s

    transfer_s        the timeout of one KV push or read (a transfer engine call). Past it
                      the call gives up, then waits as long again for ranges still in
                      flight to end: so a call returns within `transfer_bound_s`
                      (2 x transfer_s), the longest a write can land after its sender was
                      told to stop. A prefill node starts no write past its request's
                      deadline either. It must cover the largest push (bytes / bandwidth).
    cancel_ack_s      a decode node waits this long for a prefill node to confirm that none
                      of a cancelled prefill's writes can land (it first lets the writes in
                      flight end, up to transfer_bound_s); unconfirmed, the destination
                      blocks stay QUARANTINED until that node confirms, or its address
                      refuses connections (its process is gone) for transfer_bound_s, and at
                      most until the request's deadline plus transfer_bound_s. A lapsed
                      membership lease frees nothing: a stopped process resumes its writes.
    prefill_s         a decode node gives up on a prefill node after this (cancels it, then
                      prefills here).
    request_s         the gateway's deadline for a whole request (the client's own gRPC
                      deadline when that is sooner); every hop passes on what remains:
                      gateway -> decode -> prefill -> transfer.
    route_s           the gateway's Route call (answered from the meta-server's memory).
    meta_follow_s     how long the gateway looks for the leading meta-server (a standby
                      takes over within one TTL) before a request fails; never past the
                      request's deadline.
    kv_store_call_s   a node's control call to the kv-store; slower is a miss (a Release
                      with no answer is sent once more, so it takes up to twice this).
    kv_store_pin_lease_s, kv_store_reserve_lease_s
                      the store keeps a get's pinned slots / a put's reserved slots this
                      long unless released or committed sooner. A transfer starts only while
                      more than transfer_bound_s of its lease is left, so it never outlives
                      the lease; one that does anyway is detected (slot generations) and is
                      a miss, and an expired reservation's slots cool for transfer_bound_s
                      before reuse.
    kv_store_lookup_s the meta-server's Lookup at the store under cache_aware.
    progress_s        the gateway: a decode stream that sent nothing for this long is
                      checked; when its node is neither a live, unstalled member nor
                      answering SERVING to a health probe (it is stopped or hung), the
                      request migrates to another decode node; a live node is waited for
                      again.
    stall_s           a node whose current step has run this long (hung), or whose engine
                      left a command waiting this long, reports NOT_SERVING and leaves
                      routing until it makes progress. Longer than the longest healthy step
                      (a full prefill chunk), shorter than request_s.
    node_wait_s       the gateway: a request that finds no decode node to serve it (none
                      registered, the ones it tried are gone, the meta-server unreachable
                      past meta_follow_s or just restarted with no members yet) waits this
                      long for one, asking again every NODE_WAIT_POLL_S (a node that
                      pauses, restarts or is being started re-registers meanwhile), never
                      past its deadline; then it fails UNAVAILABLE. A mesh that is full
                      (RESOURCE_EXHAUSTED) is not waited for: the client hears it at once.
                      Longer than a node's pause plus one membership TTL (its
                      re-registration); the request's deadline (request_s, or the
                      client's) bounds it anyway, so a longer one is not an error.
    load_report_s     the gateway's ReportRequests call (finished requests' statistics for the
                      meta-server's planner, sent every few seconds off every request's
                      path), leader following included; a report that takes longer is
                      dropped: a slow or absent meta-server costs one report, never a request.
    weight_read_s     a starting node's read of one bucket of a weight seed's memory
                      (common/model/weight_pool.BUCKET_BYTES); past it (then as long again
                      for ranges in flight) the seed counts as stalled: the node tries the
                      next seed, then the disk. Covers a bucket at the slowest rate worth
                      waiting for (64 MiB in 30 s: 2 MB/s).
    weight_call_s     a loader's OpenWeights / RenewWeights / CloseWeights call to a seed.
    weight_lease_s    a seed keeps its weights registered this long after a loader's last
                      open or renewal: a loader that died unregisters them within it. The
                      loader renews between two bucket reads once a third of it has passed,
                      so a renewal comes at most a third of it plus a read's bound
                      (2 x weight_read_s) plus a call after the last one.

    Order: weight_lease_s / 3 + 2 x weight_read_s + weight_call_s < weight_lease_s. The
    weight timeouts are a node's start-up, apart from any request's.
    """

    transfer_s: float = 5.0
    cancel_ack_s: float = 15.0
    prefill_s: float = 30.0
    request_s: float = 600.0
    route_s: float = 5.0
    meta_follow_s: float = 8.0
    kv_store_call_s: float = 2.0
    kv_store_pin_lease_s: float = 20.0
    kv_store_reserve_lease_s: float = 30.0
    kv_store_lookup_s: float = 0.05
    progress_s: float = 2.0
    stall_s: float = 10.0
    node_wait_s: float = 30.0
    load_report_s: float = 2.0
    weight_read_s: float = 30.0
    weight_call_s: float = 5.0
    weight_lease_s: float = 120.0

    @property
    def transfer_bound_s(self) -> float:
        """The longest one transfer call runs: its timeout, then the wait for ranges in flight."""
        return 2 * self.transfer_s

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if getattr(self, f.name) <= 0:
                raise ValueError(f"timeouts.{f.name} must be > 0, got {getattr(self, f.name)}")
        order = "2 x transfer_s < cancel_ack_s < prefill_s < request_s"
        if not self.transfer_bound_s < self.cancel_ack_s:
            raise ValueError(f"2 x timeouts.transfer_s ({self.transfer_bound_s}) must be < timeouts.cancel_ack_s "
                             f"({self.cancel_ack_s}): the order must be {order}")
        chain = ("cancel_ack_s", "prefill_s", "request_s")
        for shorter, longer in zip(chain, chain[1:]):
            if not getattr(self, shorter) < getattr(self, longer):
                raise ValueError(
                    f"timeouts.{shorter} ({getattr(self, shorter)}) must be < timeouts.{longer} "
                    f"({getattr(self, longer)}): the order must be {order}")
        for name in ("progress_s", "stall_s"):
            if not getattr(self, name) < self.request_s:
                raise ValueError(f"timeouts.{name} ({getattr(self, name)}) must be < timeouts.request_s "
                                 f"({self.request_s})")
        renewal_gap = self.weight_lease_s / 3 + 2 * self.weight_read_s + self.weight_call_s
        if not renewal_gap < self.weight_lease_s:
            raise ValueError(f"timeouts.weight_lease_s ({self.weight_lease_s}) must be > a third of itself + 2 x "
                             f"timeouts.weight_read_s + timeouts.weight_call_s ({renewal_gap:g}): a seed must keep "
                             "its weights registered past a loader's slowest read and renewal")
        for lease in ("kv_store_pin_lease_s", "kv_store_reserve_lease_s"):
            if not self.transfer_bound_s < getattr(self, lease):
                raise ValueError(f"timeouts.{lease} ({getattr(self, lease)}) must be > 2 x timeouts.transfer_s "
                                 f"({self.transfer_bound_s}): a lease must outlive the transfer it guards")
