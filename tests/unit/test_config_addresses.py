"""Bind host vs advertised host: defaults keep one host for both; advertise_host changes
only what others dial; an empty transfer.hostname follows the node's advertised host."""
from __future__ import annotations

import pytest

from common.config import MetaConfig, NodeConfig, mesh_config_from_dict
from services.node.engine_node import transfer_options


def test_defaults_advertise_the_bind_host():
    assert MetaConfig(host="10.0.0.5", port=7).address == "10.0.0.5:7"
    assert NodeConfig(role="decode", node_id="d", host="10.0.0.6").advertised_host == "10.0.0.6"


def test_advertise_host_is_what_others_dial():
    meta = MetaConfig(host="0.0.0.0", advertise_host="meta-server", port=50060)
    assert meta.address == "meta-server:50060" and meta.host == "0.0.0.0"
    node = NodeConfig(role="prefill", node_id="p", host="0.0.0.0", advertise_host="prefill")
    assert node.advertised_host == "prefill" and node.host == "0.0.0.0"


def test_transfer_hostname_empty_means_the_node_name():
    raw = {"model": "m", "transfer": {"backend": "mooncake", "hostname": ""},
           "nodes": [{"role": "prefill", "node_id": "p", "host": "0.0.0.0", "advertise_host": "prefill"},
                     {"role": "decode", "node_id": "d", "host": "decode"}]}
    mesh = mesh_config_from_dict(raw)
    assert transfer_options(mesh, mesh.node("p").advertised_host)["hostname"] == "prefill"
    assert transfer_options(mesh, mesh.node("d").advertised_host)["hostname"] == "decode"
    grpc_mesh = mesh_config_from_dict({**raw, "transfer": {"backend": "grpc", "hostname": ""},   # a gRPC port
                                       "security": {"allow_plaintext": True}})   # off the loopback: bind_policy
    options = transfer_options(grpc_mesh, grpc_mesh.node("p").advertised_host)
    assert {k: options[k] for k in ("host", "timeout_s")} == {"host": "prefill", "timeout_s": 5.0}
    assert sorted(options) == ["channel_factory", "host", "interceptors", "server_credentials", "timeout_s"]
    fixed = mesh_config_from_dict({**raw, "transfer": {"backend": "mooncake", "hostname": "10.1.1.1"}})
    assert transfer_options(fixed, fixed.node("p").advertised_host)["hostname"] == "10.1.1.1"


def test_a_node_s_engine_fields_override_the_mesh_s():
    from common.config import mesh_config_from_dict
    raw = {"model": "/m", "engine": {"num_blocks": 64, "max_num_seqs": 8},
           "nodes": [{"role": "prefill", "node_id": "p0", "engine": {"num_blocks": 128, "cpu_cores": "0-1"}},
                     {"role": "decode", "node_id": "d0"}]}
    mesh = mesh_config_from_dict(raw)
    p0, d0 = mesh.engine_config(mesh.node("p0")), mesh.engine_config(mesh.node("d0"))
    assert (p0.num_blocks, p0.max_num_seqs, p0.cpu_cores) == (128, 8, (0, 1))
    assert (d0.num_blocks, d0.max_num_seqs, d0.cpu_cores) == (64, 8, ())
    assert mesh.engine_config().num_blocks == 64


@pytest.mark.parametrize("engine,error", [
    ({"model": "/other"}, r"nodes\[p0\].engine: unknown field\(s\) \['model'\]"),
    ({"blocks": 3}, r"nodes\[p0\].engine: unknown field\(s\) \['blocks'\]"),
    ([1, 2], r"nodes\[p0\].engine must be a mapping"),
    ({"lm_head_quantization": "int8"}, r"nodes\[p0\].engine.lm_head_quantization is mesh-wide: it changes the "
                                       r"embeddings, so the KV every node writes; set it in the mesh's engine section"),
])
def test_a_node_s_engine_section_names_its_bad_fields(engine, error):
    from common.config import mesh_config_from_dict
    with pytest.raises(ValueError, match=error):
        mesh_config_from_dict({"model": "/m", "nodes": [{"role": "prefill", "node_id": "p0", "engine": engine}]})


def test_a_node_s_bad_engine_value_is_named_when_its_engine_is_built():
    from common.config import mesh_config_from_dict
    mesh = mesh_config_from_dict({"model": "/m", "nodes": [{"role": "prefill", "node_id": "p0",
                                                            "engine": {"max_num_seqs": 0}}]})
    with pytest.raises(ValueError, match=r"nodes\[p0\].engine: max_num_seqs must be >= 1, got 0"):
        mesh.engine_config(mesh.node("p0"))
