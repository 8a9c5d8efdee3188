"""A decode node borrowing the prefill node's cores (common/engine/borrowed_cores.py,
engine.borrow_cores): the borrowed threads really run on the borrowed cores and stay
asleep there between borrowing spells, the engine borrows exactly for the steps in which
none of its requests waits on remote KV (and drops them after a layer when one comes),
its tokens do not change, and `pdmesh up` plans it only where the decode node sees all
of the prefill nodes' work.

Thread counts and affinities change process-wide, so the engine cases run in a child
process pinned to core 0 (they need two cores); the test process keeps its own."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from common.config import EngineConfig, mesh_config_from_dict
from common import cpu_budget
from common.engine.borrowed_cores import BorrowedCores
from common.cpu_budget import CoreShare, plan_borrowing, plan_cores

ROOT = Path(__file__).resolve().parents[2]
two_cores = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or not {0, 1} <= os.sched_getaffinity(0),
                               reason="needs cores 0 and 1")


def _child(code: str) -> dict:
    """code run in a fresh interpreter started on core 0 only; its last stdout line as JSON."""
    cmd = cpu_budget.pinned_command([sys.executable, "-c", code], (0,))
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
                              "OMP_WAIT_POLICY": "PASSIVE"})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


THREADS = """
import json, os, threading, torch
from common.engine.borrowed_cores import BorrowedCores, thread_cores
seen = {}
def on_borrowed_core():
    return sorted(t for t, cores in thread_cores().items() if cores == {1})
def steps():
    me = threading.get_native_id()
    torch.set_num_threads(1)
    b = BorrowedCores((0,), 1, (1,))
    seen["before"] = on_borrowed_core()
    b.fit(True)
    seen["borrowing"] = [torch.get_num_threads(), on_borrowed_core(), sorted(os.sched_getaffinity(0))]
    torch.randn(256, 256) @ torch.randn(256, 256)
    b.fit(False)
    seen["lent_back"] = [torch.get_num_threads(), on_borrowed_core()]
    b.fit(False)
    b.fit(True)
    b.fit(True)
    seen["again"] = [torch.get_num_threads(), on_borrowed_core(), b.num_steps, b.on_borrowed()]
    seen["same_worker"] = seen["again"][1] == seen["borrowing"][1]
    seen["me_on"] = sorted(thread_cores()[me])
t = threading.Thread(target=steps)
t.start(); t.join()
print(json.dumps(seen))
"""


@two_cores
def test_the_borrowed_thread_runs_on_the_borrowed_core_and_stays_there():
    seen = _child(THREADS)
    assert seen["before"] == []
    threads, on_core_1, step_thread_cores = seen["borrowing"]
    assert threads == 2 and len(on_core_1) == 1 and step_thread_cores == [0]
    assert seen["lent_back"] == [1, on_core_1]          # asleep in the pool, not ended
    assert seen["again"] == [2, on_core_1, 3, 1]         # the same thread again: 3 borrowed steps
    assert seen["same_worker"] and seen["me_on"] == [0]


ENGINE = """
import json, sys
from common.config import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.engine.sampling_params import SamplingParams
model, borrow = sys.argv[1], sys.argv[2] == "1"
engine = LLMEngine(EngineConfig(model, num_blocks=64, block_size=16, max_model_len=256,
                                borrow_cores=(1,) if borrow else ()))
params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
engine.add_request("local", list(range(3, 40)), params)
engine.add_request("remote", list(range(5, 30)), params, kv_remote=True)
tokens, trace = {"local": [], "remote": []}, []
def step():
    for out in engine.step():
        tokens[out.request_id] += out.new_token_ids
    b = engine.borrowed_cores
    trace.append([engine.scheduler.has_remote_kv(), b.borrowing if b else None,
                  engine.stats()["borrowed_core_steps"]])
step(); step()                           # "remote" was admitted into KV_REMOTE: no borrowing
engine.fail_remote("remote", writer_settled=True)   # computed here now: nothing remote left
while engine.has_unfinished():
    step()
late = {}
if borrow:   # a remote prefill added while a step borrows: it drops them after the layer it is in
    import torch
    b = engine.borrowed_cores
    late["before"] = [b.borrowing, torch.get_num_threads()]
    engine.add_request("late", list(range(7, 20)), params, kv_remote=True)
    b.between_layers(0)
    late["after"] = [b.borrowing, torch.get_num_threads()]
    engine.abort("late", True)
print(json.dumps({"tokens": tokens, "trace": trace, "late": late}))
"""


@two_cores
def test_the_engine_borrows_exactly_while_nothing_is_remote_and_its_tokens_do_not_change(tiny_model):
    model = str(tiny_model("llama"))
    borrowed = _child(ENGINE.replace("sys.argv[1], sys.argv[2]", f"{model!r}, '1'"))
    alone = _child(ENGINE.replace("sys.argv[1], sys.argv[2]", f"{model!r}, '0'"))
    assert borrowed["tokens"] == alone["tokens"]
    assert [len(t) for t in borrowed["tokens"].values()] == [8, 8]
    trace = borrowed["trace"]
    assert trace[:2] == [[True, False, 0], [True, False, 0]]
    rest = trace[2:]
    assert all(remote is False and borrowing is True for remote, borrowing, _ in rest)
    assert [n for _, _, n in rest] == list(range(1, len(rest) + 1))
    assert all(b is None and n == 0 for _, b, n in alone["trace"])
    assert borrowed["late"] == {"before": [True, 2], "after": [False, 1]}


def test_borrow_cores_is_checked_where_it_is_set(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    assert EngineConfig("m", cpu_cores="0", borrow_cores="1-2").borrow_cores == (1, 2)
    assert EngineConfig("m").borrow_cores == ()
    for fields, message in (
            ({"cpu_cores": "0-1", "borrow_cores": "1"}, "outside cpu_cores (0-1), got 1"),
            ({"borrow_cores": "3-4"}, "outside cpu_cores (none), got 3-4")):
        with pytest.raises(ValueError) as e:
            EngineConfig("m", **fields)
        assert str(e.value) == "borrow_cores must be cores of this host (0-3) " + message
    with pytest.raises(ValueError, match=r"^borrow_cores needs tensor_parallel_size 1, got 2$"):
        EngineConfig("m", borrow_cores="1", tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r'^borrow_cores must be core ids such as "0-3,6"'):
        EngineConfig("m", borrow_cores="x")
    with pytest.raises(ValueError, match=r"^borrow_cores must be outside the cores this engine runs on \(0-1\), got 1$"):
        BorrowedCores((0, 1), 2, (1,))


def _pd_plan(cores, nodes: dict[str, str], **kwargs):
    plan = plan_cores(cores, list(nodes), ["meta-server", "gateway"], **kwargs)
    return plan_borrowing(plan, nodes, kwargs.get("ranks"))


def test_the_plan_lends_the_prefill_cores_to_the_one_decode_node():
    plan = _pd_plan((0, 1), {"prefill-0": "prefill", "decode-0": "decode"})
    assert plan["decode-0"] == CoreShare((1,), True, 1, borrows=(0,))
    assert plan["prefill-0"] == CoreShare((0,), True, 1)
    plan = _pd_plan(tuple(range(4)), {"p0": "prefill", "p1": "prefill", "d": "decode"})
    assert plan["d"].borrows == (0, 1, 2) and plan["d"].cores == (3,)
    assert plan["d"].describe() == "cores 3, 1 thread, borrows 0-2 while the prefill node idles"


@pytest.mark.parametrize("nodes, kwargs", [
    ({"p": "prefill", "d0": "decode", "d1": "decode"}, {}),     # two decode nodes would share them
    ({"b": "both"}, {}),
    ({"p": "prefill", "b": "both"}, {}),                          # no decode node
    ({"p": "prefill", "d": "decode"}, {"explicit": {"d": (1,)}}),
    ({"p": "prefill", "d": "decode"}, {"ranks": {"p": 2, "d": 1}}),
])
def test_the_plan_lends_nothing_where_the_decode_node_cannot_see_the_work(nodes, kwargs):
    cores = (0, 1, 2) if kwargs.get("ranks") else (0, 1)
    plan = _pd_plan(cores, nodes, **kwargs)
    assert all(share.borrows == () for share in plan.values())
    unpinned = plan_cores((0,), ["p", "d"], [])    # more engines than cores: nobody pinned
    assert plan_borrowing(unpinned, {"p": "prefill", "d": "decode"}) == unpinned


class _FakePopen:
    started: list = []

    def __init__(self, cmd, **kwargs):
        self.cmd, self.pid = cmd, 4242
        _FakePopen.started.append(self)


@pytest.mark.parametrize("borrow", [True, False])
def test_the_launcher_passes_the_borrowed_cores_to_the_decode_node(monkeypatch, tmp_path, borrow):
    from services.cli import launcher
    monkeypatch.setattr(cpu_budget, "allowed_cpus", lambda: (0, 1))
    monkeypatch.setattr(launcher.subprocess, "Popen", _FakePopen)
    _FakePopen.started = []
    raw = {"model": "m", "meta_server": {"port": 0}, "gateway": {"port": 0},
           "nodes": [{"role": "prefill", "node_id": "prefill-0"}, {"role": "decode", "node_id": "decode-0"}]}
    mesh = launcher.MeshProcesses(str(tmp_path / "mesh.yaml"), mesh_config_from_dict(raw), tmp_path,
                                  quiet=True, borrow_cores=borrow)
    mesh._plan()
    for svc in mesh.services.values():
        mesh._spawn(svc)
    cmds = {name: proc.cmd for name, proc in zip(mesh.services, _FakePopen.started)}
    assert ("--borrow-cores" in cmds["prefill-0"]) is False
    decode = cmds["decode-0"]
    if borrow:
        assert decode[decode.index("--borrow-cores") + 1] == "0"
        assert mesh.services["decode-0"].status("healthy").endswith(
            "(pid 4242, cores 1, 1 thread, borrows 0 while the prefill node idles)")
    else:
        assert "--borrow-cores" not in decode
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    own = {**raw, "nodes": [raw["nodes"][0], {**raw["nodes"][1], "engine": {"borrow_cores": "0"}}]}
    mesh = launcher.MeshProcesses("x.yaml", mesh_config_from_dict(own), tmp_path, quiet=True)
    mesh._plan()      # the config's own borrow_cores wins: nothing planned on top
    assert all(s.cpu.borrows == () for s in mesh.services.values())


def test_borrow_cores_belongs_to_a_decode_node_alone():
    raw = {"model": "m", "nodes": [{"role": "prefill", "node_id": "prefill-0"}, {"role": "decode", "node_id": "decode-0"}]}
    with pytest.raises(ValueError) as e:
        mesh_config_from_dict({**raw, "engine": {"borrow_cores": "0"}})
    assert str(e.value) == ("engine.borrow_cores would lend cores to every node: set it in a decode "
                            "node's own section (nodes[].engine.borrow_cores)")
    prefill = {**raw["nodes"][0], "engine": {"borrow_cores": "1"}}
    with pytest.raises(ValueError) as e:
        mesh_config_from_dict({**raw, "nodes": [prefill, raw["nodes"][1]]})
    assert str(e.value) == ("nodes[prefill-0].engine.borrow_cores: only a decode node borrows cores, "
                            "this node's role is prefill")


def test_a_quarantined_remote_writer_counts_as_remote_work(tiny_model):
    """Blocks a prefill node may still write: it may still be computing, so nothing is
    borrowed until its writes are known to have ended. (An engine of its own: a cached
    one may carry an AsyncEngine's admission hook from an earlier test.)"""
    from common.engine.llm_engine import LLMEngine
    from common.engine.sampling_params import SamplingParams
    engine = LLMEngine(EngineConfig(str(tiny_model("llama")), num_blocks=64, block_size=16, max_model_len=256))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.add_request("q", list(range(3, 30)), params, kv_remote=True)
    engine.admit_remote()
    assert engine.scheduler.has_remote_kv() and "q" in engine.scheduler.remote
    engine.abort("q", writer_settled=False)
    assert "q" not in engine.scheduler.remote and engine.scheduler.has_remote_kv()
    engine.release_quarantine("q")
    assert not engine.scheduler.has_remote_kv() and engine.num_used_blocks == 0
