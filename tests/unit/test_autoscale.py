"""`pdmesh up --autoscale`: the bounds (parsed with errors that say what is wrong), the
pool decisions (autoscale_plan.plan_role) and the autoscaler's steps over a recording
stand-in for the mesh (its real hands, LocalMesh, run in
tests/integration/test_autoscale_mesh.py): grow to the planner's count with exact node ids,
shrink by draining, newest first, never below MIN or above MAX, and a drained node is
stopped only once idle however long that takes."""
from __future__ import annotations

import json

import pytest

from common.config import mesh_config_from_dict
from services.cli.autoscale_plan import (DRAIN_SETTLE_S, Action, Bounds, NodeState, PoolNode, busy,
                                         check_autoscale, parse_autoscale, plan_role)
from services.cli.autoscaler import Autoscaler, PlannerView
from protos.pdmesh.v1 import engine_pb2


# ---- bounds ---------------------------------------------------------------------------

def test_parse_autoscale_bounds():
    assert parse_autoscale("prefill=1:3,decode=1:3") == {"prefill": Bounds(1, 3), "decode": Bounds(1, 3)}
    assert parse_autoscale(" decode = 2:2 ") == {"decode": Bounds(2, 2)}
    assert parse_autoscale("prefill=0:2") == {"prefill": Bounds(0, 2)}   # decode nodes prefill themselves


@pytest.mark.parametrize("text, message", [
    ("", "--autoscale must be ROLE=MIN:MAX[,ROLE=MIN:MAX] with ROLE prefill or decode, e.g. "
         "prefill=1:3,decode=1:3, got ''"),
    ("decode=1:2,", "--autoscale must be ROLE=MIN:MAX"),
    ("decode", "--autoscale: 'decode' is not ROLE=MIN:MAX"),
    ("gpu=1:2", "--autoscale: role must be one of prefill, decode, got 'gpu'"),
    ("both=1:2", "--autoscale: role must be one of prefill, decode, got 'both'"),
    ("decode=1:2,decode=1:3", "--autoscale: decode is given twice"),
    ("decode=1-3", "--autoscale decode: bounds must be MIN:MAX, two whole numbers, got '1-3'"),
    ("decode=-1:3", "--autoscale decode: bounds must be MIN:MAX, two whole numbers, got '-1:3'"),
    ("decode=3:1", "--autoscale decode: need MIN <= MAX and MAX >= 1, got 3:1"),
    ("prefill=0:0", "--autoscale prefill: need MIN <= MAX and MAX >= 1, got 0:0"),
    ("decode=0:2", "--autoscale decode: MIN must be >= 1"),
])
def test_parse_autoscale_errors(text, message):
    with pytest.raises(ValueError) as e:
        parse_autoscale(text)
    assert str(e.value).startswith(message)


def _mesh(nodes, planner=True, tmp_path=None):
    meta = {"planner": {"enabled": True, "profile": "p.json"}} if planner else {}
    return mesh_config_from_dict({"model": "m", "meta_server": meta,
                                  "nodes": [{"role": r, "node_id": n} for r, n in nodes]})


def test_check_autoscale_needs_the_planner_and_fits_the_config():
    check_autoscale(_mesh([("prefill", "p0"), ("decode", "d0")]), parse_autoscale("prefill=1:3,decode=1:3"))
    with pytest.raises(ValueError, match=r"^--autoscale follows the meta-server's planner: set "
                                         r"meta_server.planner.enabled: true"):
        check_autoscale(_mesh([("decode", "d0")], planner=False), parse_autoscale("decode=1:3"))
    with pytest.raises(ValueError) as e:   # a `both` node is in the decode pool
        check_autoscale(_mesh([("decode", "d0"), ("both", "b0")]), parse_autoscale("decode=1:1"))
    assert str(e.value) == "--autoscale decode=1:1: the config lists 2 decode nodes ['d0', 'b0'], more than MAX"


# ---- plan_role ---------------------------------------------------------------------------

def _pool(*specs):
    """(node_id, from_config, state) -> PoolNodes of the decode pool, seq in order given."""
    return [PoolNode(n, "decode", cfg, seq, state) for seq, (n, cfg, state) in enumerate(specs)]


S, D, ST = NodeState.SERVING, NodeState.DRAINING, NodeState.STARTING


def _ids():
    return iter(f"decode-a{i}" for i in range(1, 10))


def test_plan_grows_to_desired_with_new_ids_and_within_max():
    pool = _pool(("decode-0", True, S))
    assert plan_role("decode", 3, Bounds(1, 3), pool, _ids()) == [
        Action("start", "decode-a1", "decode"), Action("start", "decode-a2", "decode")]
    assert plan_role("decode", 9, Bounds(1, 2), pool, _ids()) == [Action("start", "decode-a1", "decode")]
    assert plan_role("decode", 1, Bounds(1, 3), pool, _ids()) == []
    assert plan_role("prefill", 3, Bounds(1, 3), pool, _ids()) == [       # another pool: its own count
        Action("start", "decode-a1", "prefill"), Action("start", "decode-a2", "prefill"), Action(
            "start", "decode-a3", "prefill")]


def test_plan_shrinks_by_draining_started_nodes_newest_first_never_below_min():
    pool = _pool(("decode-0", True, S), ("decode-1", True, S), ("decode-a1", False, S), ("decode-a2", False, S))
    assert plan_role("decode", 3, Bounds(1, 4), pool, _ids()) == [Action("drain", "decode-a2", "decode")]
    assert plan_role("decode", 1, Bounds(1, 4), pool, _ids()) == [
        Action("drain", "decode-a2", "decode"), Action("drain", "decode-a1", "decode"),
        Action("drain", "decode-1", "decode")]   # then the config's, last listed first
    assert plan_role("decode", 0, Bounds(2, 4), pool, _ids()) == [
        Action("drain", "decode-a2", "decode"), Action("drain", "decode-a1", "decode")]
    assert plan_role("decode", None, Bounds(2, 4), pool, _ids()) == []      # no decision: bounds only


def test_plan_undrains_before_starting_and_waits_for_starts_before_shrinking():
    pool = _pool(("decode-0", True, S), ("decode-a1", False, D))
    pool[1].drained_at = 5.0
    assert plan_role("decode", 3, Bounds(1, 3), pool, iter(["decode-a2"])) == [
        Action("undrain", "decode-a1", "decode"), Action("start", "decode-a2", "decode")]
    starting = _pool(("decode-0", True, S), ("decode-a1", False, ST))
    assert plan_role("decode", 1, Bounds(1, 3), starting, _ids()) == []
    below = _pool(("decode-0", True, D))
    assert plan_role("decode", None, Bounds(1, 3), below, _ids()) == [Action("undrain", "decode-0", "decode")]


def test_busy_names_every_field_that_holds_a_node():
    assert busy(engine_pb2.EngineStats(used_blocks=7, free_blocks=3, total_blocks=10)) == {}
    stats = engine_pb2.EngineStats(running=1, waiting=2, kv_remote=3, held=4, pending_transfers=5,
                                   quarantined_blocks=6)
    assert busy(stats) == {"running": 1, "waiting": 2, "kv_remote": 3, "held": 4, "pending_transfers": 5,
                           "quarantined_blocks": 6}


# ---- the autoscaler's steps -----------------------------------------------------------------

class Hands:
    """Records what the autoscaler does; starts finish at once unless told to fail."""

    def __init__(self, nodes):
        self.nodes, self.calls = list(nodes), []
        self.view = PlannerView(0, {}, {})
        self.running = {n for n, _ in nodes}
        self.work_of: dict[str, dict | None] = {}
        self.exit: dict[str, int] = {}
        self.fail_start = False

    def config_nodes(self):
        return list(self.nodes)

    def taken(self, node_id):
        return node_id in self.running

    def read_planner(self):
        return self.view

    def decide(self, **desired):
        self.view = PlannerView(self.view.num_decisions + 1, desired, {r: f"why {r}" for r in desired})

    def drain(self, node_id):
        self.calls.append(("drain", node_id))

    def undrain(self, node_id):
        self.calls.append(("undrain", node_id))

    def forget(self, node_id):
        self.calls.append(("forget", node_id))

    def work(self, node_id):
        return self.work_of.get(node_id, {})

    def exit_code(self, node_id):
        return self.exit.get(node_id)

    def start(self, node_id, role):
        self.calls.append(("start", node_id))
        self.running.add(node_id)

        def wait():
            if self.fail_start:
                raise RuntimeError(f"{node_id} did not start: process exited with code 1")
        return wait

    def stop(self, node_id):
        self.calls.append(("stop", node_id))
        self.running.discard(node_id)

    def close(self):
        pass


class Scaler:
    """An Autoscaler over Hands on a clock the test moves."""

    def __init__(self, nodes, spec, drain_report_s=60.0):
        self.now, self.lines = 0.0, []
        self.hands = Hands(nodes)
        self.scaler = Autoscaler(self.hands, parse_autoscale(spec), interval_s=2.0, say=self.lines.append,
                                 clock=lambda: self.now, drain_report_s=drain_report_s)

    def step(self, seconds: float = 1.0) -> None:
        """Let seconds pass, finish the threads' work, step."""
        self.now += seconds
        self.scaler.settle()
        self.scaler.step()
        self.scaler.settle()
        self.scaler.step()

    def states(self) -> dict[str, str]:
        return {n.node_id: n.state.name for n in self.scaler.nodes.values()}

    def calls(self) -> list:
        calls, self.hands.calls = self.hands.calls, []
        return calls


def test_grows_to_the_planner_count_with_exact_ids_then_drains_back_to_min():
    s = Scaler([("prefill-0", "prefill"), ("decode-0", "decode")], "decode=1:3")
    s.step()
    assert s.calls() == [] and s.states() == {"decode-0": "SERVING"}   # prefill is not autoscaled
    s.hands.decide(prefill=5, decode=3)
    s.step()
    assert s.calls() == [("start", "decode-a1"), ("start", "decode-a2")]
    assert s.states() == {"decode-0": "SERVING", "decode-a1": "SERVING", "decode-a2": "SERVING"}
    assert s.lines == ["autoscale    decode      1 -> 3 nodes (planner decision 1: why decode)",
                       "decode-a1    decode      starting (autoscale)",
                       "decode-a2    decode      starting (autoscale)"]
    s.step()
    assert s.calls() == []                     # the same decision is acted on once
    s.hands.decide(decode=0)                   # below MIN: 1; the newest first
    s.lines.clear()
    s.step()
    assert s.calls() == [("drain", "decode-a2"), ("drain", "decode-a1")]
    assert s.states() == {"decode-0": "SERVING", "decode-a1": "DRAINING", "decode-a2": "DRAINING"}
    assert s.scaler.owns("decode-a1") and not s.scaler.owns("decode-0")
    s.step(DRAIN_SETTLE_S)
    s.step(DRAIN_SETTLE_S)
    calls = s.calls()                          # each node on a thread of its own: stop, then forget
    assert [c for c in calls if c[1] == "decode-a1"] == [("stop", "decode-a1"), ("forget", "decode-a1")]
    assert [c for c in calls if c[1] == "decode-a2"] == [("stop", "decode-a2"), ("forget", "decode-a2")]
    assert len(calls) == 4
    assert s.states() == {"decode-0": "SERVING"}
    assert s.lines[:2] == ["autoscale    decode      the planner wants 0 nodes; held within 1..3",
                           "autoscale    decode      3 -> 1 nodes (planner decision 2: why decode)"]
    assert "decode-a2    decode      drained in 1.0s; stopping" in s.lines
    s.hands.decide(decode=2)                   # ids are not reused within a run
    s.step()
    assert s.calls() == [("start", "decode-a3")]


def test_above_max_is_held_and_said_once():
    s = Scaler([("decode-0", "decode")], "decode=1:2")
    for _ in range(2):
        s.hands.decide(decode=5)
        s.step()
    assert s.calls() == [("start", "decode-a1")]
    assert [line for line in s.lines if "held" in line] == [
        "autoscale    decode      the planner wants 5 nodes; held within 1..2"]


def test_a_busy_drained_node_is_not_stopped_however_long_it_takes():
    s = Scaler([("decode-0", "decode"), ("decode-1", "decode")], "decode=1:2", drain_report_s=30.0)
    s.hands.decide(decode=1)
    s.step()
    assert s.calls() == [("drain", "decode-1")]      # a config node: the last listed
    s.hands.work_of["decode-1"] = {"running": 2, "pending_transfers": 1}
    for _ in range(40):                               # 80 s, past the report
        s.step(2.0)
    assert s.calls() == [] and s.states()["decode-1"] == "DRAINING"
    assert [line for line in s.lines if "still" in line] == [
        "decode-1     decode      still draining after 30s (2 running, 1 pending transfers); not stopped while "
        "it has work"]
    s.hands.work_of["decode-1"] = None                # no answer is not idle either
    s.step(2.0)
    s.step(2.0)
    assert s.calls() == []
    s.hands.work_of["decode-1"] = {"quarantined_blocks": 3}
    s.step(2.0)
    s.hands.work_of["decode-1"] = {}                  # idle: stopped once it stayed so DRAIN_SETTLE_S
    s.step(0.6)                                       # the first idle poll
    assert s.calls() == []
    s.step(DRAIN_SETTLE_S)
    assert s.calls() == [("stop", "decode-1"), ("forget", "decode-1")]
    assert s.states() == {"decode-0": "SERVING"}


def test_a_draining_node_wanted_again_is_undrained_not_replaced():
    s = Scaler([("decode-0", "decode")], "decode=1:3")
    s.hands.decide(decode=2)
    s.step()
    s.hands.decide(decode=1)
    s.hands.work_of["decode-a1"] = {"running": 1}
    s.step()
    s.hands.decide(decode=3)
    s.step()
    assert s.calls() == [("start", "decode-a1"), ("drain", "decode-a1"), ("undrain", "decode-a1"),
                         ("start", "decode-a2")]
    assert s.states() == {"decode-0": "SERVING", "decode-a1": "SERVING", "decode-a2": "SERVING"}


def test_lower_bound_at_start_a_failed_start_and_an_exit_while_draining():
    s = Scaler([("decode-0", "decode")], "prefill=1:2,decode=1:2")
    s.hands.fail_start = True
    s.step()                                          # no prefill node: MIN 1 without a decision
    assert s.calls() == [("start", "prefill-a1"), ("stop", "prefill-a1")]
    assert s.lines[0] == "autoscale    prefill     0 -> 1 nodes (below the lower bound)"
    assert s.lines[-1] == ("prefill-a1   prefill     did not start: prefill-a1 did not start: process exited "
                           "with code 1")
    assert s.states() == {"decode-0": "SERVING"}
    s.hands.fail_start = False
    s.hands.decide(prefill=1, decode=2)               # the next decision tries again, a new id
    s.step()
    assert s.calls() == [("start", "prefill-a2"), ("start", "decode-a1")]
    s.hands.decide(prefill=1, decode=1)
    s.hands.work_of["decode-a1"] = {"running": 1}
    s.step()
    s.hands.exit["decode-a1"] = -9
    s.step()
    assert s.calls() == [("drain", "decode-a1"), ("stop", "decode-a1"), ("forget", "decode-a1")]
    assert "decode-a1    decode      exited with code -9 while draining; not restarted" in s.lines
    assert s.states() == {"decode-0": "SERVING", "prefill-a2": "SERVING"}


@pytest.mark.parametrize("extra, planner, message", [
    (["--autoscale", "decode=1:2"], False, "error: --autoscale follows the meta-server's planner: set "
                                           "meta_server.planner.enabled: true"),
    (["--autoscale", "decode=2"], True, "error: --autoscale decode: bounds must be MIN:MAX"),
    (["--autoscale", "decode=1:2", "--demo"], True, "error: --autoscale follows the load of a serving mesh"),
])
def test_pdmesh_up_refuses_a_bad_autoscale_before_anything_starts(tmp_path, capsys, extra, planner, message):
    from services.cli import main
    (tmp_path / "profile.json").write_text("{}")
    meta = {"planner": {"enabled": True, "profile": str(tmp_path / "profile.json")}} if planner else {}
    config = tmp_path / "mesh.yaml"
    config.write_text(json.dumps({"model": str(tmp_path / "no-model"), "meta_server": meta,
                                  "nodes": [{"role": "decode", "node_id": "decode-0"}]}))
    assert main(["up", "--config", str(config), "--log-dir", str(tmp_path / "logs"), *extra]) == 2
    assert capsys.readouterr().err.startswith(message)
    assert not (tmp_path / "logs").exists()
