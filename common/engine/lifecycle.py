"""The lifecycle of a request's KV: one ordered state, every transition checked here.

The scheduler owns the state of each Sequence and moves it only through `advance`; the
services never touch it (they call the engine's narrow interface: add, commit or fail a
remote fill, abort, release).

    WAITING ──admit──> ALLOCATED ──compute here──────────────────> RUNNING ──stop|length──> FINISHED
       ▲                   │                                        │  │ └─hold_blocks──> HELD ──release──> FINISHED
       │                   │ KV from elsewhere                      │  └─preempt: blocks freed ──> WAITING
       │                   ▼                                        │
       │               KV_REMOTE ──landed (first token or n tokens)──> KV_READY ──next schedule──> RUNNING
       │                   │  └──failed, writer settled: compute here from the local hit ──> KV_READY
       └──failed, writer unconfirmed: its blocks stay QUARANTINED; fresh blocks, compute here

    abort: any live state -> ABORTED, blocks freed; KV_REMOTE whose writer has not confirmed
    that none of its writes can land -> QUARANTINED (blocks kept) -> ABORTED once it has, or
    once it is known dead plus the transfer timeout.

- WAITING: queued, no blocks. Also after preemption: then it is recomputed here from prompt
  + generated tokens (prefix-cache hits make that cheap); a request preempted after a remote
  prefill never goes back to KV_REMOTE, so no first token is committed twice.
- ALLOCATED: blocks for every token, local prefix hits first (`num_computed_tokens`).
- KV_REMOTE: a prefill node (decode side) or the kv-store (prefill side) fills the blocks
  past the local hit. Holds a seat, not in the batch, never preempted.
- KV_READY: the KV landed (`num_computed_tokens` says how much); it joins the batch at the
  next schedule. A prefill node's first token is appended on the way in.
- RUNNING: in the batch, computing its prompt in chunks, then one token a step.
- HELD: a prefill node's request after its first token; its blocks are the source of a KV
  push and stay referenced until released.
- QUARANTINED: ended, its blocks kept because a remote writer may still write them.
- FINISHED / ABORTED: done, blocks freed. `finish_reason` is stop | length | abort.
"""
from __future__ import annotations

from enum import IntEnum


class RequestState(IntEnum):
    WAITING = 0
    ALLOCATED = 1
    KV_REMOTE = 2
    KV_READY = 3
    RUNNING = 4
    HELD = 5
    QUARANTINED = 6
    FINISHED = 7
    ABORTED = 8

    @property
    def done(self) -> bool:
        return self >= RequestState.FINISHED


S = RequestState
TRANSITIONS: dict[RequestState, frozenset[RequestState]] = {
    S.WAITING: frozenset({S.ALLOCATED, S.ABORTED}),
    S.ALLOCATED: frozenset({S.RUNNING, S.KV_REMOTE, S.WAITING, S.ABORTED}),  # WAITING: did not fit the step
    S.KV_REMOTE: frozenset({S.KV_READY, S.WAITING, S.QUARANTINED, S.ABORTED}),
    S.KV_READY: frozenset({S.RUNNING, S.HELD, S.FINISHED, S.ABORTED}),       # the first token may end it
    S.RUNNING: frozenset({S.WAITING, S.HELD, S.FINISHED, S.ABORTED}),
    S.HELD: frozenset({S.FINISHED, S.ABORTED}),
    S.QUARANTINED: frozenset({S.ABORTED}),
    S.FINISHED: frozenset(),
    S.ABORTED: frozenset(),
}


class IllegalTransition(AssertionError):
    """A bug: the engine tried a transition the lifecycle does not have."""


def advance(seq, to: RequestState) -> None:
    """Move seq (anything with `state` and `request_id`) to `to`; IllegalTransition if the
    lifecycle has no such edge."""
    if to not in TRANSITIONS[seq.state]:
        raise IllegalTransition(f"request {seq.request_id}: {seq.state.name} -> {to.name}")
    seq.state = to
