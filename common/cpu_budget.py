"""The CPU budget of one process: the cores it may run on and the threads torch uses there.

    cpu_cores   core ids, "0-3,6" in YAML; () = not pinned (the affinity the process was
                started with stays: all cores, or what `pdmesh up`, taskset or a
                container's cpuset gave it)
    num_threads torch's intra-op (OpenMP) threads; 0 = one per core of cpu_cores, or
                torch's default (about one per core the process may use) when not pinned

`apply(cpu_cores, num_threads)` is what an engine process runs (LLMEngine.__init__) before
its first torch op: it pins every thread of the process, so every thread started later
too, then sets torch's thread count (ATen, MKL and oneDNN follow it).

libgomp, ATen's OpenMP, reads its environment once, when torch is imported: the wait
policy (OMP_WAIT_POLICY, GOMP_SPINCOUNT) and thread binding (OMP_PROC_BIND, OMP_PLACES,
GOMP_CPU_AFFINITY) therefore reach an engine only through the environment it was started
with; `openmp_env` is what `pdmesh up` puts there, and bench/cores.py measured the
choice (docs/benchmarks.md). Nothing here imports torch at module level, so the config
and the launcher can use the parsing helpers cheaply.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("pdmesh.engine")

# What `pdmesh up` puts in an engine process's environment (a variable already set there
# wins): OpenMP threads that sleep at once when they run out of work, instead of spinning
# (libgomp's default, up to 300,000 spins) on cores that the engine's own event loop, its
# gRPC threads or a neighbour need. bench/cores.py: with 2 threads and a busy neighbour
# the default spin made decode steps several times slower; PASSIVE held them.
OPENMP_WAIT_ENV: dict[str, str] = {"OMP_WAIT_POLICY": "PASSIVE"}


def parse_cpu_list(spec: Any, name: str = "cpu_cores") -> tuple[int, ...]:
    """"0-3,6" / [0, 1] / ["0-1", 4] / 3 -> sorted unique core ids; "" / None / [] -> ().
    ValueError naming `name` for anything else."""
    if spec is None or spec == "" or spec == () or spec == []:
        return ()
    items = spec if isinstance(spec, (list, tuple)) else [spec]
    ids: set[int] = set()
    for item in items:
        if isinstance(item, bool):
            raise _bad_list(name, spec)
        if isinstance(item, int):
            if item < 0:
                raise _bad_list(name, spec)
            ids.add(item)
            continue
        if not isinstance(item, str):
            raise _bad_list(name, spec)
        for part in item.split(","):
            lo, sep, hi = part.strip().partition("-")
            if not lo.strip().isdigit() or (sep and not hi.strip().isdigit()):
                raise _bad_list(name, spec)
            first, last = int(lo), int(hi) if sep else int(lo)
            if last < first:
                raise _bad_list(name, spec)
            ids.update(range(first, last + 1))
    return tuple(sorted(ids))


def _bad_list(name: str, spec: Any) -> ValueError:
    return ValueError(f'{name} must be core ids such as "0-3,6" or [0, 1], got {spec!r}')


def format_cpu_list(ids) -> str:
    """(0, 1, 2, 3, 6) -> "0-3,6" (the form taskset and /sys/.../cpulist use)."""
    runs: list[list[int]] = []
    for i in sorted(set(ids)):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def allowed_cpus() -> tuple[int, ...]:
    """The cores this process may run on; () where the OS cannot say (not Linux)."""
    if not hasattr(os, "sched_getaffinity"):
        return ()
    return tuple(sorted(os.sched_getaffinity(0)))


def check_cpu_cores(cpu_cores: tuple[int, ...], name: str = "cpu_cores") -> None:
    """ValueError unless every id is a core this process may run on."""
    if not cpu_cores:
        return
    allowed = allowed_cpus()
    if not allowed:
        raise ValueError(f"{name} needs os.sched_setaffinity (Linux); leave it empty here")
    outside = [c for c in cpu_cores if c not in allowed]
    if outside:
        raise ValueError(f"{name} must be among the cores this process may run on "
                         f"({format_cpu_list(allowed)}), got {format_cpu_list(cpu_cores)}")


def pin_process(cpu_cores: tuple[int, ...]) -> None:
    """Pin every thread of this process to cpu_cores (threads it starts later inherit
    it). sched_setaffinity(0) alone would move only the calling thread."""
    cores = set(cpu_cores)
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cores)
        except (ProcessLookupError, PermissionError):
            pass   # the thread ended meanwhile


def apply(cpu_cores: tuple[int, ...], num_threads: int) -> int:
    """Apply the budget to this process (see the module docstring); returns the number of
    threads torch runs with. Mutates process-wide state: call it once, before the model
    runs."""
    import torch
    if cpu_cores:
        pin_process(cpu_cores)
    threads = num_threads or len(cpu_cores)
    if threads:
        torch.set_num_threads(threads)
    threads = torch.get_num_threads()
    waits = {k: os.environ[k] for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_PROC_BIND")
             if k in os.environ}
    log.info("cpu budget: cores %s%s, %d thread(s)%s", format_cpu_list(allowed_cpus()) or "?",
             "" if cpu_cores else " (as the process started)", threads,
             "".join(f", {k}={v}" for k, v in waits.items()))
    return threads


def openmp_env(num_threads: int) -> dict[str, str]:
    """The environment an engine process should start with for num_threads OpenMP
    threads: OMP_NUM_THREADS, plus OPENMP_WAIT_ENV."""
    return {"OMP_NUM_THREADS": str(num_threads), **OPENMP_WAIT_ENV} if num_threads else dict(OPENMP_WAIT_ENV)


_PIN_AND_EXEC = ("import os, sys; os.sched_setaffinity(0, {int(c) for c in sys.argv[1].split(',')}); "
                 "os.execv(sys.argv[2], sys.argv[2:])")


def pinned_command(cmd: list[str], cpu_cores: tuple[int, ...]) -> list[str]:
    """cmd started on cpu_cores from its first instruction (as `taskset -c` would; the
    pid stays cmd's, the pinning is inherited by every thread it starts); cmd itself when
    cpu_cores is empty or the OS cannot pin."""
    if not cpu_cores or not hasattr(os, "sched_setaffinity"):
        return list(cmd)
    return [sys.executable, "-S", "-c", _PIN_AND_EXEC, ",".join(map(str, cpu_cores)), *cmd]


@dataclass(frozen=True)
class CoreShare:
    """The cores one service of a mesh runs on (`pdmesh up`). cores: the set it runs on
    (when not pinned: every core the launcher may use); num_threads: an engine's OpenMP
    threads (0 = not an engine, or torch's default); by_config: engine.cpu_cores set them."""

    cores: tuple[int, ...]
    pinned: bool
    num_threads: int = 0
    by_config: bool = False
    borrows: tuple[int, ...] = ()   # a decode node's engine.borrow_cores (plan_borrowing)

    def describe(self) -> str:
        text = f"cores {format_cpu_list(self.cores) or 'all'}" + ("" if self.pinned else " (not pinned)")
        if self.num_threads:
            text += f", {self.num_threads} thread{'s' if self.num_threads > 1 else ''}"
        if self.borrows:
            text += f", borrows {format_cpu_list(self.borrows)} while the prefill node idles"
        return text + (", from engine.cpu_cores" if self.by_config else "")


# A core goes to the control plane only when each planned engine keeps this many. On 2
# cores a colocated engine on both served 1.4-1.8x the tokens/s of one on a single core
# with meta-server and gateway on the other (bench/cores.py --serving); halving an
# engine costs more than the control plane gains (the node's own event loop and gRPC
# threads share the engine's cores).
MIN_CORES_TO_SPARE_ONE = 2

def plan_cores(available: tuple[int, ...], engine_nodes: list[str], control_services: list[str],
               explicit: dict[str, tuple[int, ...]] | None = None, num_threads: int = 0,
               ranks: dict[str, int] | None = None) -> dict[str, CoreShare]:
    """How `pdmesh up` spreads the host's cores (available) over a mesh's processes:

    - an engine node in explicit keeps its cores (engine.cpu_cores);
    - the other engine nodes split the remaining cores into contiguous shares as even as
      possible, a node at tensor_parallel_size N (ranks) counting as N engines, one
      share per rank (earlier ranks get the extra core), one thread per core, after one
      core is kept back for the control plane when each of those ranks still gets at
      least MIN_CORES_TO_SPARE_ONE (so never on 2 cores: a colocated node there gets
      both); a node's ranks split its share between them (common/parallel/executor.py);
    - with more such ranks than cores, no node is pinned and each rank runs one thread;
    - the control services (meta-server, kv-store, gateway) are pinned to the cores no
      engine holds, or not pinned when every core is an engine's.

    num_threads (engine.num_threads) > 0 overrides one thread per core. Pure: plans,
    pins nothing."""
    explicit = explicit or {}
    taken = {c for cores in explicit.values() for c in cores}
    free = [c for c in available if c not in taken]
    planned = [n for n in engine_nodes if n not in explicit]
    plan = {n: CoreShare(explicit[n], True, num_threads or len(explicit[n]), by_config=True)
            for n in engine_nodes if n in explicit}
    size_of = {n: max(1, (ranks or {}).get(n, 1)) for n in planned}
    units = sum(size_of.values())
    if not planned:
        spare = free
    elif units > len(free):
        plan.update({n: CoreShare(tuple(available), False, num_threads or size_of[n]) for n in planned})
        spare = []
    else:
        reserve = 1 if len(free) - 1 >= MIN_CORES_TO_SPARE_ONE * units else 0
        engine_cores, spare = free[:len(free) - reserve], free[len(free) - reserve:]
        share, extra = divmod(len(engine_cores), units)
        start, unit = 0, 0
        for name in planned:
            size = sum(share + (1 if unit + r < extra else 0) for r in range(size_of[name]))
            unit += size_of[name]
            cores = tuple(engine_cores[start:start + size])
            plan[name] = CoreShare(cores, True, num_threads or len(cores))
            start += size
    for name in control_services:
        plan[name] = CoreShare(tuple(spare), True) if spare else CoreShare(tuple(available), False)
    return plan


def plan_borrowing(plan: dict[str, CoreShare], roles: dict[str, str],
                   ranks: dict[str, int] | None = None) -> dict[str, CoreShare]:
    """plan with the decode node lent the prefill nodes' cores (engine.borrow_cores,
    common/engine/borrowed_cores.py) where that is safe: exactly one node of role decode
    and at least one of role prefill, none of them placed by engine.cpu_cores or
    unpinned, every one at tensor_parallel_size 1, the cores disjoint. The decode node
    is then the only one whose prompts those prefill nodes compute, so its rule (borrow
    while none of its prompts is prefilled remotely) sees all their work. Pure."""
    ranks = ranks or {}
    decode = [n for n, r in roles.items() if r == "decode"]
    prefill = [n for n, r in roles.items() if r == "prefill"]
    nodes = decode + prefill
    if len(decode) != 1 or not prefill or any(
            n not in plan or not plan[n].pinned or plan[n].by_config or ranks.get(n, 1) > 1 for n in nodes):
        return plan
    lent = tuple(sorted({c for n in prefill for c in plan[n].cores}))
    if set(lent) & set(plan[decode[0]].cores):
        return plan
    return {**plan, decode[0]: dataclasses.replace(plan[decode[0]], borrows=lent)}
