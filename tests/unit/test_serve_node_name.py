"""`pdmesh serve ROLE --node-id ENTRY --node-name NAME`: a scaled pool's pod (deploy/k8s
prefill-pool, decode-pool) runs as node NAME with ENTRY's config; refused for the other
roles before anything loads (exit code 2, one line)."""
from __future__ import annotations

import pytest

from common.config import mesh_config_from_dict
from services.cli import build_parser, main
from services.cli.serve import _node_config, with_node_name


def test_the_entry_gives_everything_but_the_id():
    mesh = mesh_config_from_dict({"model": "m", "nodes": [
        {"role": "decode", "node_id": "decode-pool", "host": "0.0.0.0", "advertise_host": "decode-pool",
         "port": 50072, "metrics_port": 9106, "engine": {"num_blocks": 64}}]})
    entry = _node_config(mesh, "decode", "decode-pool")
    node = with_node_name(entry, "decode", "decode-pool-3")
    assert node.node_id == "decode-pool-3"
    assert (node.role, node.host, node.port, node.metrics_port, node.engine) == ("decode", "0.0.0.0", 50072, 9106,
                                                                               {"num_blocks": 64})
    assert mesh.engine_config(node) == mesh.engine_config(entry)
    with pytest.raises(ValueError, match="must not be empty"):
        with_node_name(entry, "decode", " ")


def test_only_engine_roles_take_a_node_name(tmp_path, capsys):
    config = tmp_path / "mesh.yaml"
    config.write_text("model: m\nnodes: [{role: decode, node_id: d0}]\n")
    args = ["serve", "gateway", "--config", str(config), "--node-name", "x"]
    assert build_parser().parse_args(args).node_name == "x"
    assert main(args) == 2
    assert capsys.readouterr().out == "error: --node-name is for the engine roles (prefill, decode, both), not gateway\n"
