"""What `pdmesh quantize` leaves float whatever the scheme, beside the embeddings, norms and
lm_head:

    <layer>.self_attn.kv_b_proj      MLA (DeepSeek-V2/V3): the decode absorbs it into the
                                     query and the output (layers/mla.py refuses it
                                     quantized before reading a byte)
    <layer>.mlp.gate (.weight, .e_score_correction_bias), Mixtral's block_sparse_moe.gate
                                     the MoE router: not a Linear the engine quantizes
                                     (layers/moe_router.py), read float in every scheme
    the routed experts               under a scheme the MoE layer cannot read them in
                                     (experts.py)

msModelSlim's description types each of them FLOAT (every tensor the writer did not
quantize); compressed-tensors' config names them in `ignore`, whose "Linear" target would
otherwise claim them (the engine's loader and other readers, vLLM's, alike).
"""
from __future__ import annotations

import re

FLOAT_PROJECTIONS = {"self_attn.kv_b_proj": "MLA's decode absorbs it into the query and output"}
ROUTER_GATE = re.compile(r"(.+\.(?:mlp|block_sparse_moe)\.gate)\.weight")
EXPERTS_IGNORE = r"re:.*\.experts($|\.)"     # the routed experts (and a fused experts module), not shared_experts


def stays_float(projection: str) -> bool:
    """Whether a checkpoint projection (e.g. "model.layers.0.self_attn.kv_b_proj") is kept
    float in every scheme."""
    return ".".join(projection.split(".")[-2:]) in FLOAT_PROJECTIONS


def router_gates(tensor_names) -> list[str]:
    """The MoE routers' module names (e.g. "model.layers.3.mlp.gate"), in name order."""
    return sorted(m.group(1) for n in tensor_names if (m := ROUTER_GATE.fullmatch(n)))


def float_modules(kept_projections: list[str], gates: list[str], float_experts: bool) -> list[str]:
    """compressed-tensors' `ignore` entries beside "lm_head" for what stayed float."""
    return [*kept_projections, *gates, *([EXPERTS_IGNORE] if float_experts else [])]


def kept_float_summary(kept_projections: list[str], gates: list[str], float_experts_why: str | None) -> str | None:
    """The one log line naming what stayed float beyond the embeddings, norms and lm_head
    (None: nothing did)."""
    parts = []
    for suffix, why in FLOAT_PROJECTIONS.items():
        names = [p for p in kept_projections if p.endswith(suffix)]
        if names:
            parts.append(f"{suffix.rsplit('.', 1)[-1]} in {len(names)} layer(s) ({why})")
    if gates:
        parts.append(f"the router gate of {len(gates)} MoE layer(s) (not a Linear the engine quantizes)")
    if float_experts_why:
        parts.append(f"the routed experts ({float_experts_why})")
    return "stayed FLOAT: " + "; ".join(parts) if parts else None
