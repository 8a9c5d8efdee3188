"""Tiny DeepSeek checkpoints saved by transformers (random weights, the tiny tokenizer):
"deepseek_v2" (no q_lora: one q_proj; default rope; softmax group-limited-greedy router) and
"deepseek_v3" (q_lora; yarn rope with mscale, so both the softmax scale and cos/sin carry
it; grouped sigmoid router with its correction bias), each with a dense first layer, MoE
layers with a shared expert, and MLA (layers/mla.py) in every layer."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

COMMON = dict(vocab_size=1024, hidden_size=128, intermediate_size=192, num_hidden_layers=3, num_attention_heads=8,
              kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24, moe_intermediate_size=32,
              n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
              max_position_embeddings=2048, initializer_range=0.15, bos_token_id=1, eos_token_id=2)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 512,
        "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 1.0}


def deepseek_v2(**sizes):
    import transformers
    return transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(
        q_lora_rank=None, n_group=4, topk_group=2, topk_method="group_limited_greedy", routed_scaling_factor=1.5,
        **{**COMMON, **sizes}))


def deepseek_v3(**sizes):
    import transformers
    return transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        q_lora_rank=48, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
        rope_parameters=dict(YARN), **{**COMMON, **sizes}))


FAMILIES = {"deepseek_v2": deepseek_v2, "deepseek_v3": deepseek_v3}


def save(family: str, out: Path, tokenizer_dir: Path, layout: str = "per-expert", **sizes):
    """Build `family` (seed 7; V3's router bias random too, as a trained one is), COMMON's
    sizes but for `sizes` (e.g. kv_lora_rank=512), save it with the tokenizer of
    tokenizer_dir, its experts per expert or in transformers 5's fused tensors (layout
    "fused"); returns the transformers model (eval)."""
    torch.manual_seed(7)
    model = FAMILIES[family](**sizes).eval()
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape) * 0.1)
    model.save_pretrained(out, save_original_format=layout == "per-expert")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / f, out / f)
    return model


@pytest.fixture(scope="module")
def saved_deepseek(tmp_path_factory, tiny_model):
    """saved_deepseek(family, layout="per-expert", **sizes) -> (folder, transformers model)."""
    made = {}

    def get(family: str, layout: str = "per-expert", **sizes):
        key = (family, layout, tuple(sorted(sizes.items())))
        if key not in made:
            out = tmp_path_factory.mktemp(f"{family}-{layout}")
            made[key] = (out, save(family, out, tiny_model("llama"), layout, **sizes))
        return made[key]

    return get
