"""Cores a decode node borrows from the prefill node beside it while that node has
nothing of this node's to compute.

On one host, 1 prefill + 1 decode node each run pinned to their own cores
(cpu_budget.plan_cores). Once a burst of prompts is prefilled, the prefill node's cores
sit idle while the decode node decodes on its own; a colocated node would decode on all
of them. `engine.borrow_cores` names such cores: the decode node's steps add one OpenMP
thread per borrowed core for every step in which none of its requests is prefilled
remotely (the scheduler holds no request in KV_REMOTE and none waiting to get there),
and drop them again as soon as one arrives: `want_back()` (called when a request that
will be prefilled remotely is added, from whichever thread adds it) makes the step in
flight drop them at its next layer boundary (`between_layers`: after each layer's
attention, and before the logits), so a prefill node starting on that request shares
its cores for about one layer, not for the rest of a decode step. Blocks a remote
writer may still write (quarantined) count as remote work too.

The rule sees only this node's requests: it is right where the prefill nodes on those
cores serve this decode node alone (what `pdmesh up` plans: one decode node and the
prefill nodes on the host). Prefills those nodes run for anyone else (another mesh's
decode nodes, say) share the cores with this node's borrowed threads for as long as
they last; don't lend cores there.

How the threads get there: a thread's CPU affinity is copied to the threads it creates.
Each time the count goes up, the step thread moves itself onto the borrowed cores, raises
torch's thread count and runs one parallel op, so the OpenMP runtime (libgomp) starts its
new pool threads there, then moves itself back onto its own cores (the own threads are
started on the own cores first, so the pool's first threads are those). libgomp keeps a
pool thread asleep (OMP_WAIT_POLICY=PASSIVE) while the steps run with fewer threads, and
starts a new one when it ended it. Under OMP_WAIT_POLICY=ACTIVE parked threads would
spin on the borrowed cores for good: nothing is borrowed then. `on_borrowed` counts what did land on the borrowed
cores, so a runtime that places threads otherwise shows up as a warning, once.

Not thread-safe: the step thread calls fit() between steps (LLMEngine.step).
"""
from __future__ import annotations

import logging
import os

import torch

from common.cpu_budget import format_cpu_list, parse_cpu_list

log = logging.getLogger("pdmesh.engine")

# one op over this many floats runs on every thread (ATen's grain size is 32,768)
_SPAWN_NUMEL = 1 << 20


def thread_cores() -> dict[int, frozenset[int]]:
    """Every thread of this process -> the cores it may run on (Linux /proc)."""
    cores: dict[int, frozenset[int]] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/status") as status:
                for line in status:
                    if line.startswith("Cpus_allowed_list:"):
                        cores[int(tid)] = frozenset(parse_cpu_list(line.split(":", 1)[1].strip()))
        except OSError:
            pass   # the thread ended meanwhile
    return cores


class BorrowedCores:
    """own_cores / own_threads: what the engine runs on anyway (cpu_budget.apply);
    borrowed: the cores it may add, one thread each (disjoint from own_cores)."""

    def __init__(self, own_cores: tuple[int, ...], own_threads: int, borrowed: tuple[int, ...]):
        if not own_cores or not borrowed or set(own_cores) & set(borrowed):
            raise ValueError(f"borrow_cores must be outside the cores this engine runs on "
                             f"({format_cpu_list(own_cores)}), got {format_cpu_list(borrowed)}")
        self.own_cores, self.own_threads, self.borrowed = tuple(own_cores), own_threads, tuple(borrowed)
        self.borrowing = False
        self.usable = os.environ.get("OMP_WAIT_POLICY", "").lower() != "active"   # False: never borrow
        if not self.usable:
            log.warning("borrow_cores %s unused: OMP_WAIT_POLICY=ACTIVE would keep threads spinning there",
                        format_cpu_list(borrowed))
        self.num_steps = 0        # steps run with the borrowed cores
        self._warned = False
        self._wanted_back = False

    def want_back(self) -> None:
        """Any thread: the borrowed cores are needed back (a remote prefill is coming); the
        step in flight drops them at its next layer boundary."""
        self._wanted_back = True

    def clear_wanted_back(self) -> None:
        """Step thread, before fit(): what want_back asked for is in the rule from now."""
        self._wanted_back = False

    def between_layers(self, layer: int) -> None:
        """Step thread, inside the forward pass after each layer's attention and before
        the logits: drop the borrowed threads when want_back() was called."""
        if self._wanted_back and self.borrowing:
            torch.set_num_threads(self.own_threads)
            self.borrowing = False

    def fit(self, borrow: bool) -> None:
        """Before a step, after clear_wanted_back() (borrow: the rule, evaluated after the
        flag was cleared, so a later want_back still reaches this step): run it with the
        borrowed cores or on the own ones only."""
        borrow = borrow and self.usable
        if borrow != self.borrowing:
            if borrow:
                borrow = self._start_borrowed_threads()
            else:
                torch.set_num_threads(self.own_threads)
            self.borrowing = borrow
        if borrow:
            self.num_steps += 1

    def _start_borrowed_threads(self) -> bool:
        torch.set_num_threads(self.own_threads)
        torch.empty(_SPAWN_NUMEL).fill_(0.0)   # the own pool threads exist, on the own cores
        try:
            os.sched_setaffinity(0, set(self.borrowed))
        except OSError as e:   # outside this container's cpuset, say: stay on the own cores
            self.usable = False
            log.warning("borrow_cores %s cannot be used here (%s); running on cores %s only",
                        format_cpu_list(self.borrowed), e, format_cpu_list(self.own_cores))
            return False
        try:
            torch.set_num_threads(self.own_threads + len(self.borrowed))
            torch.empty(_SPAWN_NUMEL).fill_(0.0)   # a parallel region of every thread: the pool grows here
        finally:
            os.sched_setaffinity(0, set(self.own_cores))
        landed = self.on_borrowed()
        if landed < len(self.borrowed) and not self._warned:
            self._warned = True
            log.warning("borrow_cores %s: %d of %d borrowed threads run there (this OpenMP runtime "
                        "places its threads otherwise)", format_cpu_list(self.borrowed), landed,
                        len(self.borrowed))
        return True

    def on_borrowed(self) -> int:
        """How many threads of this process may run only on borrowed cores."""
        borrowed = set(self.borrowed)
        return sum(1 for cores in thread_cores().values() if cores <= borrowed)
