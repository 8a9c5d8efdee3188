"""What a fault case reads from the services' own counters to show that its path ran:
the bytes the prefill node's transfer engine pushed, the requests decode nodes have
waiting on remote KV, the kv-store's Stats. Counters are read as deltas over the case
(they only grow while a process lives), never as absolutes an earlier case moved."""
from __future__ import annotations

from tests.integration.conftest import engine_stats
from tests.integration.test_mesh import kv_bytes, kv_store_stats


def prefill_pushed(mesh, name: str = "prefill-0") -> int:
    """KV bytes the prefill node's transfer engine has written (acknowledged) since it started."""
    return engine_stats(mesh.services[name].address, "prefill").transfer_bytes_written


def waiting_on_remote_kv(mesh) -> int:
    """Requests the live decode nodes hold in KV_REMOTE (a prefill node is filling them)."""
    return sum(engine_stats(s.address, "decode").kv_remote for s in mesh.services.values()
               if s.role == "decode" and s.process.poll() is None)


def store_bytes_in(mesh) -> int:
    """Bytes of blocks the kv-store committed (puts) since it started."""
    return kv_store_stats(mesh.services["kv-store"].address).bytes_in


def assert_prefill_pushed(case: str, mesh, model_dir, work, outcomes, pushed_before: int) -> int:
    """The prefill node computed this case's prompts: at least one request says a prefill
    node computed its prompt, and the prefill node pushed at least the KV of every such
    prompt (its own: no node held a prefix of it; a migrated request may add more).
    Returns the bytes pushed during the case."""
    remote = [len(work.prompts[i]) for i, o in enumerate(outcomes) if o.error is None and o.remote_prefill]
    pushed = prefill_pushed(mesh) - pushed_before
    assert remote, f"{case}: no prompt was prefilled on the prefill node"
    assert pushed >= kv_bytes(model_dir, sum(remote)), \
        f"{case}: the prefill node pushed {pushed} bytes, less than the KV of the {len(remote)} prompts it computed"
    return pushed


class PushStarted:
    """Predicate, a latch: the prefill node has pushed KV since this was made. A case's
    prompts are its own (tests/faults/workload.py), so the prefill node computes all of
    them, over several steps of max_num_batched_tokens: the latch is reached in every run,
    and decode nodes still wait on the steps after the first push."""

    def __init__(self, mesh):
        self.mesh = mesh
        self.before = prefill_pushed(mesh)
        self.polls = 0

    def __call__(self) -> bool:
        self.polls += 1
        return prefill_pushed(self.mesh) > self.before

    def describe(self) -> str:
        return f"; {self.polls} polls, the prefill node pushed {prefill_pushed(self.mesh) - self.before} bytes"
