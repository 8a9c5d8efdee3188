"""Bind host vs advertised host: defaults keep one host for both; advertise_host changes
only what others dial; an empty transfer.hostname follows the node's advertised host."""
from __future__ import annotations

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
    grpc_mesh = mesh_config_from_dict({**raw, "transfer": {"backend": "grpc", "hostname": ""}})
    options = transfer_options(grpc_mesh, grpc_mesh.node("p").advertised_host)
    assert {k: options[k] for k in ("host", "timeout_s")} == {"host": "prefill", "timeout_s": 5.0}
    assert sorted(options) == ["channel_factory", "host", "interceptors", "server_credentials", "timeout_s"]
    fixed = mesh_config_from_dict({**raw, "transfer": {"backend": "mooncake", "hostname": "10.1.1.1"}})
    assert transfer_options(fixed, fixed.node("p").advertised_host)["hostname"] == "10.1.1.1"
