"""Tiny Mixture-of-Experts checkpoints saved by transformers (random weights, the tiny
tokenizer), in either expert layout: "per-expert" (save_original_format=True: experts.{e}.
gate_proj / up_proj / down_proj, Mixtral's w1 / w3 / w2) or "fused" (transformers 5's
experts.gate_up_proj [E, 2I, H] and down_proj [E, H, I])."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

IDS = [1, 17, 400, 9, 23, 610, 5, 77, 301, 12, 990, 45, 3]
COMMON = dict(vocab_size=1024, hidden_size=128, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=4,
              max_position_embeddings=2048, initializer_range=0.15, bos_token_id=1, eos_token_id=2)


def qwen3_moe():
    import transformers
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        intermediate_size=256, moe_intermediate_size=64, head_dim=32, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1], **COMMON))


def mixtral():
    import transformers
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, sliding_window=None, **COMMON))


FAMILIES = {"qwen3_moe": qwen3_moe, "mixtral": mixtral}


def save(family: str, layout: str, out: Path, tokenizer_dir: Path):
    """Build `family` (seed 7), save it to out in `layout` with the tokenizer of
    tokenizer_dir; returns the transformers model (eval mode)."""
    torch.manual_seed(7)
    model = FAMILIES[family]().eval()
    model.save_pretrained(out, save_original_format=layout == "per-expert")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / f, out / f)
    return model


def greedy_reference(model, max_new_tokens: int = 10) -> tuple[torch.Tensor, list[int]]:
    """(prompt log-probs [len(IDS) - 1, vocab] float64, greedy continuation of IDS)."""
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([IDS])).logits[0, :-1].double(), -1)
        want = model.generate(torch.tensor([IDS]), max_new_tokens=max_new_tokens, do_sample=False)[0, len(IDS):]
    return ref, want.tolist()
