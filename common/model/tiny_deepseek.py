"""The DeepSeek-V3 part of the tiny maker (common/model/tiny.py): its config fields and the
tensors of its MLA attention and its MoE layers, in DeepSeek's checkpoint names.

Sizes follow hidden_size: q_lora_rank 3/8 of it, kv_lora_rank 1/4, per head qk_nope 1/8,
qk_rope 1/16 (even, >= 4), v_head 1/8; layer 0 dense, the rest MoE with one shared expert
and DeepSeek-V3's grouped sigmoid router (4 groups, the best 2 kept); yarn rope with
mscale, as the released configs have.
"""
from __future__ import annotations

from typing import Callable

import torch

ROPE_SCALING = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "beta_fast": 32,
                "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


def deepseek_fields(hidden: int, intermediate: int, experts: int, top_k: int, rope_scaling: dict | None) -> dict:
    """rope_scaling: the caller's, else ROPE_SCALING."""
    rope = max(4, hidden // 16 // 2 * 2)
    return dict(q_lora_rank=hidden * 3 // 8, kv_lora_rank=hidden // 4, qk_nope_head_dim=hidden // 8,
                qk_rope_head_dim=rope, head_dim=rope, v_head_dim=hidden // 8, n_routed_experts=experts,
                num_experts_per_tok=top_k, n_shared_experts=1, moe_intermediate_size=-(-intermediate // 64) * 16,
                first_k_dense_replace=1, moe_layer_freq=1, n_group=4, topk_group=2, topk_method="noaux_tc",
                norm_topk_prob=True, routed_scaling_factor=2.5, scoring_func="sigmoid", rope_interleave=True,
                num_nextn_predict_layers=0, attention_bias=False, rope_scaling=dict(rope_scaling or ROPE_SCALING))


def mla_tensors(prefix: str, config: dict, linear: Callable, norm: Callable, gains: dict) -> dict[str, torch.Tensor]:
    """`<prefix>self_attn.*` of one layer: q_a / q_b, kv_a_proj_with_mqa, kv_b, o and the norms."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    q_lora, rank = config["q_lora_rank"], config["kv_lora_rank"]
    nope, rope, v = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    p = prefix + "self_attn."
    return {p + "q_a_proj.weight": linear(q_lora, hidden, 1.0), p + "q_a_layernorm.weight": norm(q_lora),
            p + "q_b_proj.weight": linear(heads * (nope + rope), q_lora, gains["qk_gain"]),
            p + "kv_a_proj_with_mqa.weight": linear(rank + rope, hidden, gains["qk_gain"]),
            p + "kv_a_layernorm.weight": norm(rank),
            p + "kv_b_proj.weight": linear(heads * (nope + v), rank, gains["qk_gain"]),
            p + "o_proj.weight": linear(hidden, heads * v, gains["out_gain"])}


def moe_tensors(prefix: str, config: dict, linear: Callable, normal: Callable,
                gains: dict) -> dict[str, torch.Tensor]:
    """`<prefix>mlp.*` of a MoE layer: the gate with its correction bias, the routed
    experts and the shared one."""
    hidden, inter = config["hidden_size"], config["moe_intermediate_size"]
    experts, shared = config["n_routed_experts"], inter * config["n_shared_experts"]
    p = prefix + "mlp."
    t = {p + "gate.weight": linear(experts, hidden, gains["router_gain"]),
         p + "gate.e_score_correction_bias": normal(experts, std=0.1)}
    for e in range(experts):
        for name, shape in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)), ("down_proj", (hidden, inter))):
            t[f"{p}experts.{e}.{name}.weight"] = linear(*shape, gains["out_gain" if name == "down_proj" else "mlp_gain"])
    for name, shape in (("gate_proj", (shared, hidden)), ("up_proj", (shared, hidden)), ("down_proj", (hidden, shared))):
        t[f"{p}shared_experts.{name}.weight"] = linear(*shape, gains["out_gain" if name == "down_proj" else "mlp_gain"])
    return t
