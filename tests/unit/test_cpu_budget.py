"""The CPU budget (common/cpu_budget.py): cpu_cores parsed and validated in
EngineConfig, really applied to an engine process, and `pdmesh up`'s plan of who runs on
which cores. Pinning happens only in child processes: the test process keeps its cores."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from common.config import EngineConfig, mesh_config_from_dict
from common import cpu_budget
from common.cpu_budget import CoreShare, format_cpu_list, parse_cpu_list, plan_cores

ROOT = Path(__file__).resolve().parents[2]
CONTROL = ["meta-server", "kv-store", "gateway"]
needs_affinity = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs sched_setaffinity")


def _child(code: str, env: dict[str, str] | None = None) -> dict:
    """Run code in a fresh interpreter at the repository root; its last stdout line as JSON."""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("spec, ids", [
    ("0-3,6", (0, 1, 2, 3, 6)), (" 2 , 0-1 ", (0, 1, 2)), ([1, "0"], (0, 1)), ((3,), (3,)), (3, (3,)),
    ("5-5", (5,)), ([0, 0, 1], (0, 1)), ("", ()), (None, ()), ([], ()), ((), ())])
def test_parse_cpu_list(spec, ids):
    assert parse_cpu_list(spec) == ids


@pytest.mark.parametrize("spec", ["x", "3-1", "-1", "0-", "1,,2", "0-1-2", -1, 1.5, [True], {"a": 1}])
def test_parse_cpu_list_refuses(spec):
    with pytest.raises(ValueError) as e:
        parse_cpu_list(spec)
    assert str(e.value) == f'cpu_cores must be core ids such as "0-3,6" or [0, 1], got {spec!r}'


def test_format_cpu_list():
    assert format_cpu_list((6, 0, 1, 2, 3)) == "0-3,6"
    assert format_cpu_list([1]) == "1"
    assert format_cpu_list([0, 2, 4, 5]) == "0,2,4-5"
    assert format_cpu_list([]) == ""


def test_engine_config_normalizes_cpu_cores(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    assert EngineConfig("m", cpu_cores="1-2").cpu_cores == (1, 2)
    assert EngineConfig("m", cpu_cores=[3, 0]).cpu_cores == (0, 3)
    assert EngineConfig("m").cpu_cores == ()
    assert EngineConfig.from_kwargs("m", cpu_cores="0").cpu_cores == (0,)


def test_engine_config_refuses_cores_outside_the_process(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    with pytest.raises(ValueError) as e:
        EngineConfig("m", cpu_cores="0,5-6")
    assert str(e.value) == "cpu_cores must be among the cores this process may run on (0-1), got 0,5-6"
    with pytest.raises(ValueError) as e:
        EngineConfig("m", cpu_cores="zero")
    assert str(e.value) == "cpu_cores must be core ids such as \"0-3,6\" or [0, 1], got 'zero'"


def test_yaml_cpu_cores_reach_the_engine_config(monkeypatch, tmp_path):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    raw = yaml.safe_load("model: m\nengine: {cpu_cores: '0-1', num_threads: 1}\n")
    assert mesh_config_from_dict(raw).engine_config().cpu_cores == (0, 1)
    raw = yaml.safe_load("model: m\nengine: {cpu_cores: [1]}\n")
    assert mesh_config_from_dict(raw).engine_config().cpu_cores == (1,)


def test_pdmesh_up_refuses_a_bad_cpu_cores_before_starting(tmp_path, capsys):
    from services.cli import main
    cfg = tmp_path / "mesh.yaml"
    cfg.write_text(yaml.safe_dump({"model": str(tmp_path / "none"), "engine": {"cpu_cores": "0-4095"},
                                   "nodes": [{"role": "both", "node_id": "b0"}]}))
    assert main(["up", "--config", str(cfg), "--log-dir", str(tmp_path / "logs")]) == 2
    allowed = format_cpu_list(os.sched_getaffinity(0))
    assert capsys.readouterr().err.strip() == (
        f"error: cpu_cores must be among the cores this process may run on ({allowed}), got 0-4095")


@needs_affinity
def test_engine_process_runs_on_its_cpu_cores(tiny_model):
    """LLMEngine pins its whole process, threads started before it included, and runs
    one torch thread per core."""
    core = max(os.sched_getaffinity(0))
    got = _child(f"""
import json, os, threading, time
ready = threading.Event()
threading.Thread(target=lambda: (ready.set(), time.sleep(60)), daemon=True).start()
ready.wait()
import torch
from common.config import EngineConfig
from common.engine.llm_engine import LLMEngine
LLMEngine(EngineConfig({str(tiny_model())!r}, cpu_cores=[{core}], num_blocks=8))
masks = sorted({{tuple(sorted(os.sched_getaffinity(int(t)))) for t in os.listdir("/proc/self/task")}})
print(json.dumps({{"process": sorted(os.sched_getaffinity(0)), "threads": masks, "torch": torch.get_num_threads()}}))
""")
    assert got == {"process": [core], "threads": [[core]], "torch": 1}


@needs_affinity
def test_num_threads_wins_over_one_per_core():
    cores = sorted(os.sched_getaffinity(0))
    got = _child(f"""
import json, os, torch
from common import cpu_budget
n = cpu_budget.apply(({cores[0]},), 2)
print(json.dumps({{"process": sorted(os.sched_getaffinity(0)), "torch": torch.get_num_threads(), "n": n}}))
""")
    assert got == {"process": [cores[0]], "torch": 2, "n": 2}


def test_no_budget_keeps_the_process_as_it_started():
    got = _child("""
import json, os, torch
from common import cpu_budget
before = torch.get_num_threads()
n = cpu_budget.apply((), 0)
print(json.dumps({"process": sorted(os.sched_getaffinity(0)), "same": n == before == torch.get_num_threads()}))
""")
    assert got == {"process": sorted(os.sched_getaffinity(0)), "same": True}


@needs_affinity
def test_pinned_command_starts_the_command_on_its_cores():
    core = min(os.sched_getaffinity(0))
    cmd = cpu_budget.pinned_command([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                                    (core,))
    assert subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip() == f"[{core}]"
    assert cpu_budget.pinned_command(["x", "y"], ()) == ["x", "y"]


def test_openmp_env():
    assert cpu_budget.openmp_env(2) == {"OMP_NUM_THREADS": "2", **cpu_budget.OPENMP_WAIT_ENV}
    assert cpu_budget.openmp_env(0) == cpu_budget.OPENMP_WAIT_ENV


# --- pdmesh up's plan ------------------------------------------------------------------

def _cores(plan) -> dict[str, tuple]:
    return {name: (share.cores, share.pinned, share.num_threads) for name, share in plan.items()}


def test_plan_one_prefill_one_decode_on_two_cores():
    """One core each; the control plane shares both (no core to spare)."""
    plan = plan_cores((0, 1), ["prefill-0", "decode-0"], CONTROL)
    assert _cores(plan) == {"prefill-0": ((0,), True, 1), "decode-0": ((1,), True, 1),
                            "meta-server": ((0, 1), False, 0), "kv-store": ((0, 1), False, 0),
                            "gateway": ((0, 1), False, 0)}


def test_plan_colocated_on_two_cores_gives_the_engine_both():
    plan = plan_cores((0, 1), ["both-0"], ["meta-server", "gateway"])
    assert _cores(plan) == {"both-0": ((0, 1), True, 2), "meta-server": ((0, 1), False, 0),
                            "gateway": ((0, 1), False, 0)}


def test_plan_spares_a_core_only_when_each_engine_keeps_two():
    plan = plan_cores((0, 1, 2), ["both-0"], ["gateway"])
    assert _cores(plan) == {"both-0": ((0, 1), True, 2), "gateway": ((2,), True, 0)}
    plan = plan_cores((0, 1, 2, 3), ["p", "d"], ["gateway"])
    assert _cores(plan) == {"p": ((0, 1), True, 2), "d": ((2, 3), True, 2), "gateway": ((0, 1, 2, 3), False, 0)}
    plan = plan_cores((0, 1, 2, 3, 4), ["p", "d"], ["gateway"])
    assert _cores(plan) == {"p": ((0, 1), True, 2), "d": ((2, 3), True, 2), "gateway": ((4,), True, 0)}
    plan = plan_cores((0,), ["both-0"], ["gateway"])
    assert _cores(plan) == {"both-0": ((0,), True, 1), "gateway": ((0,), False, 0)}


def test_plan_keeps_one_core_for_the_control_plane_and_splits_the_rest():
    plan = plan_cores(tuple(range(8)), ["prefill-0", "prefill-1", "decode-0"], CONTROL)
    assert _cores(plan) == {"prefill-0": ((0, 1, 2), True, 3), "prefill-1": ((3, 4), True, 2),
                            "decode-0": ((5, 6), True, 2), "meta-server": ((7,), True, 0),
                            "kv-store": ((7,), True, 0), "gateway": ((7,), True, 0)}
    plan = plan_cores((2, 3, 5, 7, 8, 9), ["p", "d"], ["gateway"])   # ids as the process has them
    assert _cores(plan) == {"p": ((2, 3, 5), True, 3), "d": ((7, 8), True, 2), "gateway": ((9,), True, 0)}


def test_plan_more_engines_than_cores_pins_none_and_runs_one_thread_each():
    plan = plan_cores((0, 1), ["p0", "p1", "d0"], ["gateway"])
    assert _cores(plan) == {"p0": ((0, 1), False, 1), "p1": ((0, 1), False, 1), "d0": ((0, 1), False, 1),
                            "gateway": ((0, 1), False, 0)}


def test_plan_explicit_cores_win_and_the_rest_goes_to_the_control_plane():
    plan = plan_cores((0, 1, 2, 3), ["p", "d"], ["gateway"], explicit={"p": (0, 1), "d": (0, 1)})
    assert plan["p"] == CoreShare((0, 1), True, 2, by_config=True)
    assert plan["d"] == CoreShare((0, 1), True, 2, by_config=True)
    assert plan["gateway"] == CoreShare((2, 3), True)
    plan = plan_cores((0, 1), ["p", "d"], ["gateway"], explicit={"p": (0, 1), "d": (0, 1)})
    assert plan["gateway"] == CoreShare((0, 1), False)
    plan = plan_cores((0, 1, 2, 3), ["p", "d"], ["gateway"], explicit={"p": (3,)})
    assert _cores(plan) == {"p": ((3,), True, 1), "d": ((0, 1), True, 2), "gateway": ((2,), True, 0)}


def test_plan_counts_a_tensor_parallel_node_as_one_engine_per_rank():
    plan = plan_cores(tuple(range(6)), ["p", "d"], ["gateway"], ranks={"p": 2, "d": 1})
    assert _cores(plan) == {"p": ((0, 1, 2, 3), True, 4), "d": ((4, 5), True, 2), "gateway": ((0, 1, 2, 3, 4, 5), False, 0)}
    plan = plan_cores(tuple(range(7)), ["p", "d"], ["gateway"], ranks={"p": 2, "d": 1})
    assert _cores(plan) == {"p": ((0, 1, 2, 3), True, 4), "d": ((4, 5), True, 2), "gateway": ((6,), True, 0)}
    plan = plan_cores((0, 1, 2), ["p", "d"], ["gateway"], ranks={"p": 2, "d": 2})     # 4 ranks, 3 cores
    assert _cores(plan) == {"p": ((0, 1, 2), False, 2), "d": ((0, 1, 2), False, 2), "gateway": ((0, 1, 2), False, 0)}


def test_plan_num_threads_overrides_one_per_core():
    plan = plan_cores((0, 1, 2, 3), ["p", "d"], [], num_threads=1)
    assert _cores(plan) == {"p": ((0, 1), True, 1), "d": ((2, 3), True, 1)}


def test_core_share_describes_itself():
    assert CoreShare((0,), True, 1).describe() == "cores 0, 1 thread"
    assert CoreShare((0, 1, 2), True, 3, by_config=True).describe() == "cores 0-2, 3 threads, from engine.cpu_cores"
    assert CoreShare((0, 1), False).describe() == "cores 0-1 (not pinned)"
    assert CoreShare((0, 1), False, 1).describe() == "cores 0-1 (not pinned), 1 thread"


class _FakePopen:
    started: list = []

    def __init__(self, cmd, env, **kwargs):
        self.cmd, self.env, self.pid = cmd, env, 4242
        _FakePopen.started.append(self)


def test_launcher_starts_each_service_on_its_share(monkeypatch, tmp_path):
    """1 prefill + 1 decode + kv-store on 2 cores: the engines start pinned with one
    OpenMP thread each; the control plane starts unpinned; status lines say so."""
    from services.cli import launcher
    monkeypatch.setattr(cpu_budget, "allowed_cpus", lambda: (0, 1))
    monkeypatch.setattr(launcher.subprocess, "Popen", _FakePopen)
    for var in ("OMP_NUM_THREADS", *cpu_budget.OPENMP_WAIT_ENV):
        monkeypatch.delenv(var, raising=False)
    _FakePopen.started = []
    raw = {"model": "m", "meta_server": {"port": 0}, "gateway": {"port": 0}, "kv_store": {"port": 0},
           "nodes": [{"role": "prefill", "node_id": "prefill-0"}, {"role": "decode", "node_id": "decode-0"}]}
    mesh = launcher.MeshProcesses(str(tmp_path / "mesh.yaml"), mesh_config_from_dict(raw), tmp_path, quiet=True)
    mesh._plan()
    for svc in mesh.services.values():
        mesh._spawn(svc)
    by_name = dict(zip(mesh.services, _FakePopen.started))
    for name, core in (("prefill-0", "0"), ("decode-0", "1")):
        proc = by_name[name]
        assert proc.cmd[:5] == [sys.executable, "-S", "-c", cpu_budget._PIN_AND_EXEC, core]
        assert proc.cmd[5:9] == [sys.executable, "-m", "services.cli", "serve"]
        assert proc.env["OMP_NUM_THREADS"] == "1"
        assert proc.env["OMP_WAIT_POLICY"] == "PASSIVE"
    for name in ("meta-server", "kv-store", "gateway"):
        assert by_name[name].cmd[:4] == [sys.executable, "-m", "services.cli", "serve"]
        assert "OMP_NUM_THREADS" not in by_name[name].env and "OMP_WAIT_POLICY" not in by_name[name].env
    assert mesh.services["decode-0"].status("healthy") == (
        f"decode-0     decode      healthy at 127.0.0.1:{mesh.services['decode-0'].port} (pid 4242, cores 1, 1 thread, borrows 0 while the prefill node idles)")
    assert mesh.services["gateway"].status("healthy").endswith("(pid 4242, cores 0-1 (not pinned))")


def test_launcher_without_a_plan_leaves_every_process_on_every_core(monkeypatch, tmp_path):
    from services.cli import launcher
    monkeypatch.setattr(cpu_budget, "allowed_cpus", lambda: (0, 1))
    raw = {"model": "m", "nodes": [{"role": "both", "node_id": "both-0"}]}
    mesh = launcher.MeshProcesses("x.yaml", mesh_config_from_dict(raw), tmp_path, quiet=True, plan_cores=False)
    mesh._plan()
    assert {n: s.cpu for n, s in mesh.services.items()} == {
        "meta-server": CoreShare((0, 1), False), "both-0": CoreShare((0, 1), False),
        "gateway": CoreShare((0, 1), False)}
