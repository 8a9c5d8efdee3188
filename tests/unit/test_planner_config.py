"""The `meta_server.planner` section of a mesh config (common/planner_config.py): read from
YAML into MetaConfig.planner, defaults off, and every bad value refused naming the field."""
from __future__ import annotations

import pytest

from common.config import PlannerConfig, load_mesh_config, mesh_config_from_dict


def mesh(planner) -> dict:
    return {"model": "m", "meta_server": {"port": 50051, "planner": planner}}


def test_the_section_is_read_into_the_meta_server_config(tmp_path):
    path = tmp_path / "mesh.yaml"
    path.write_text("model: m\nmeta_server:\n  planner:\n    enabled: true\n    interval_s: 15\n"
                    "    ttft_slo_ms: 500\n    itl_slo_ms: 40\n    min_nodes: 0\n    max_nodes: 4\n"
                    "    scale_down_after: 2\n    cooldown_s: 60\n    profile: prof.json\n")
    assert load_mesh_config(str(path)).meta.planner == PlannerConfig(
        enabled=True, interval_s=15, ttft_slo_ms=500, itl_slo_ms=40, min_nodes=0, max_nodes=4,
        scale_down_after=2, cooldown_s=60, profile="prof.json")
    assert mesh_config_from_dict({"model": "m"}).meta.planner == PlannerConfig()
    assert mesh_config_from_dict(mesh(None)).meta.planner.enabled is False


@pytest.mark.parametrize("planner,error", [
    ({"enabled": "yes"}, "meta_server.planner.enabled must be true or false, got 'yes'"),
    ({"interval_s": 0}, "meta_server.planner.interval_s must be > 0, got 0"),
    ({"ttft_slo_ms": -1}, "meta_server.planner.ttft_slo_ms must be > 0, got -1"),
    ({"itl_slo_ms": "fast"}, "meta_server.planner.itl_slo_ms must be > 0, got 'fast'"),
    ({"max_nodes": 2.5}, "meta_server.planner.max_nodes must be an integer, got 2.5"),
    ({"min_nodes": 3, "max_nodes": 2}, "meta_server.planner needs 0 <= min_nodes <= max_nodes, got 3 and 2"),
    ({"scale_down_after": 0}, "meta_server.planner.scale_down_after must be >= 1, got 0"),
    ({"cooldown_s": -5}, "meta_server.planner.cooldown_s must be >= 0, got -5"),
    ({"enabled": True}, "meta_server.planner.profile is required when the planner is enabled"),
    ({"interval": 30}, "meta_server.planner: unknown field(s) ['interval']; allowed: ['cooldown_s', 'enabled', "),
    ([1], "meta_server.planner must be a mapping, got list"),
])
def test_bad_values_are_refused_naming_the_field(planner, error):
    with pytest.raises(ValueError) as err:
        mesh_config_from_dict(mesh(planner))
    assert error in str(err.value)
