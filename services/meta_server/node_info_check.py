"""What a NodeInfo may hold before the meta-server lists it to the mesh: bounded strings,
known roles and backends. The same for a node that registers by RPC and for a key read
from etcd (which pdmesh does not authenticate)."""
from __future__ import annotations

import re

from common.kv_layout import LATENT_KINDS, PLANES

NODE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
MAX_FIELD_CHARS = 256     # address, model_id, transfer endpoint, instance_id

TRANSFER_BACKENDS = ("mooncake", "grpc", "fake")
MAX_TENSOR_PARALLEL = 64
WEIGHT_IDENTITY = re.compile(r"[0-9a-f]{32}")   # common/model/weight_identity.py
# what every rank of a node has alike (each its own heads and addresses)
RANK_SHARED_FIELDS = ("kind", "dtype", "scales_id", "num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim",
                      "rope_dim")


def node_info_error(node) -> str:
    """Why a NodeInfo cannot be registered, "" if it can."""
    if not NODE_ID.fullmatch(node.node_id):
        return ("node.node_id must be 1-128 characters of letters, digits and . _ : - "
                "(starting with a letter or digit)")
    if node.role not in ("prefill", "decode", "both"):
        return "node.role must be one of prefill, decode, both"
    if not node.address:
        return "node.address is required"
    for name in ("address", "model_id", "transfer_endpoint"):
        if len(getattr(node, name)) > MAX_FIELD_CHARS:
            return f"node.{name} must be at most {MAX_FIELD_CHARS} characters"
    if node.transfer_backend and node.transfer_backend not in TRANSFER_BACKENDS:
        return f"node.transfer_backend must be one of {', '.join(TRANSFER_BACKENDS)}"
    most = 8 * max(len(node.kv_ranks), 1)   # an engine opens two (handshake, data) of its own
    if len(node.transfer_listen_addresses) > most or any(len(a) > MAX_FIELD_CHARS for a in node.transfer_listen_addresses):
        return f"node.transfer_listen_addresses: at most {most} of at most {MAX_FIELD_CHARS} characters each"
    for where, layout in (("node.kv_layout", node.kv_layout),
                          *((f"node.kv_ranks[{i}].layout", r.layout) for i, r in enumerate(node.kv_ranks))):
        if len(layout.dtype) > 32 or len(layout.strides) > 8:
            return f"{where}: dtype at most 32 characters, at most 8 strides"
        if layout.kind not in ("", *PLANES):     # "": a node from before the field (K and V)
            return f"{where}.kind must be one of {', '.join(PLANES)}"
        if layout.kind in LATENT_KINDS and layout.num_kv_heads != 1:
            return f"{where}.num_kv_heads must be 1 for kind {layout.kind}"
        if (layout.kind == "latent_split") != (layout.rope_dim > 0) or layout.rope_dim < 0:
            return f"{where}.rope_dim must be > 0 for kind latent_split and 0 otherwise"
    if not 0 <= node.tensor_parallel_size <= MAX_TENSOR_PARALLEL:
        return f"node.tensor_parallel_size must be in [0, {MAX_TENSOR_PARALLEL}] (0 or 1: one rank)"
    if len(node.kv_ranks) not in (0, max(node.tensor_parallel_size, 1)):
        return "node.kv_ranks must be empty or one entry per tensor-parallel rank"
    if any(len(r.transfer_endpoint) > MAX_FIELD_CHARS for r in node.kv_ranks):
        return f"node.kv_ranks[].transfer_endpoint must be at most {MAX_FIELD_CHARS} characters"
    if any(len(r.listen_addresses) > 8 or any(len(a) > MAX_FIELD_CHARS for a in r.listen_addresses)
           for r in node.kv_ranks):
        return f"node.kv_ranks[].listen_addresses: at most 8 of at most {MAX_FIELD_CHARS} characters each"
    if node.kv_ranks and (node.kv_ranks[0].transfer_endpoint != node.transfer_endpoint
                          or node.kv_ranks[0].layout != node.kv_layout):
        return "node.kv_ranks[0] must repeat node.transfer_endpoint and node.kv_layout (rank 0)"
    for i, r in enumerate(node.kv_ranks):
        if any(getattr(r.layout, f) != getattr(node.kv_layout, f) for f in RANK_SHARED_FIELDS):
            return f"node.kv_ranks[{i}].layout must match node.kv_layout in {', '.join(RANK_SHARED_FIELDS)}"
    seed = node.weight_seed
    if node.HasField("weight_seed") and not (
            WEIGHT_IDENTITY.fullmatch(seed.identity) and 1 <= seed.tensor_parallel_size <= MAX_TENSOR_PARALLEL
            and seed.total_bytes >= 0 and seed.max_clients >= 1):
        return ("node.weight_seed: identity of 32 hex digits, tensor_parallel_size in "
                f"[1, {MAX_TENSOR_PARALLEL}], total_bytes >= 0, max_clients >= 1")
    return ""
