"""Faults a test can inject into a running engine node process (the fault-matrix suite,
tests/faults/). Armed only when the process was started with PDMESH_FAULT_INJECTION=1;
otherwise nothing here is installed and the signals keep their default meaning.

  SIGUSR1                          the engine's next step raises (its step loop dies)
  PDMESH_FAULT_TRANSFER_FAIL_RATE  this fraction of KV writes fail with TransferError
                                   (a wrapper around the real backend), e.g. 0.1: every
                                   10th write, the first included
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import signal

from common.transfer.base import TransferError

log = logging.getLogger("pdmesh.node")
ARMED_ENV = "PDMESH_FAULT_INJECTION"
TRANSFER_FAIL_RATE_ENV = "PDMESH_FAULT_TRANSFER_FAIL_RATE"


class InjectedStepFailure(RuntimeError):
    """What the step loop raises after SIGUSR1."""


def install_fault_injection(node) -> None:
    """node: an EngineNode. No-op unless PDMESH_FAULT_INJECTION=1."""
    if os.environ.get(ARMED_ENV) != "1":
        return
    engine = node.llm_engine
    log.warning("%s: fault injection armed (%s=1): SIGUSR1 makes the next step raise",
                node.node.node_id, ARMED_ENV)
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, _fail_next_step, engine)
    rate = float(os.environ.get(TRANSFER_FAIL_RATE_ENV, "0") or 0)
    if rate > 0:
        log.warning("%s: %.0f%% of KV writes will fail (%s)", node.node.node_id, rate * 100,
                    TRANSFER_FAIL_RATE_ENV)
        _fail_writes(node.transfer, rate)


def _fail_next_step(engine) -> None:
    def step():
        raise InjectedStepFailure("injected step failure (SIGUSR1)")
    engine.step = step   # an attribute write: the step thread picks it up at its next step


def _fail_writes(transfer, rate: float) -> None:
    """Wrap transfer.write: every (1/rate)-th call, starting with the first, writes
    nothing and raises a settled TransferError (the failure a peer refusing the
    connection gives). Deterministic, so a run always sees failures."""
    write, every, calls = transfer.write, max(1, round(1 / rate)), itertools.count()

    def flaky_write(peer, batch, timeout_s=None):
        if next(calls) % every == 0:
            raise TransferError(f"injected write failure to {peer}")
        return write(peer, batch, timeout_s)
    transfer.write = flaky_write
