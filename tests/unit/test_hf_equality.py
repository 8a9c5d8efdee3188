"""Greedy tokens equal Hugging Face transformers' on tiny-maker and save_pretrained models.

transformers scores our whole output in one teacher-forced forward pass; each of our
tokens must be its argmax. A divergence is accepted only where the reference's top-2
logit margin is below 1e-4 relative (a near tie that float rounding may flip), and only
if our token is the reference's runner-up there.
"""
from __future__ import annotations

import random

import pytest
import torch

from common.engine import SamplingParams
from tests.conftest import BLOCK_SIZE

NUM_PROMPTS, NEW_TOKENS, REL_MARGIN = 16, 64, 1e-4


def mixed_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 2, 5, 9, 16, 17, 31, 40, 63, 64, 65, 100, 128, 150, 200, 257]
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths[:NUM_PROMPTS]]


@torch.inference_mode()
def hf_next_token_logits(model, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """transformers' logits for every generated position, teacher-forced on our tokens:
    row j is its distribution for token j given prompt + generated[:j]. Greedy equality
    holds exactly when each of our tokens is the argmax of its row."""
    ids = torch.tensor([prompt + generated])
    logits = model(ids).logits[0].float()
    return logits[len(prompt) - 1: len(prompt) - 1 + len(generated)]


def count_near_tie_divergences(ours: list[int], ref_logits: torch.Tensor, label: str) -> int:
    """Every position where our token is not transformers' argmax must be a near tie
    (top-2 margin below REL_MARGIN relative) where ours is the runner-up."""
    top2 = ref_logits.topk(2, dim=-1)
    ties = 0
    for pos, tok in enumerate(ours):
        best = int(top2.indices[pos, 0])
        if tok == best:
            continue
        l1, l2 = float(top2.values[pos, 0]), float(top2.values[pos, 1])
        margin = (l1 - l2) / max(abs(l1), 1e-12)
        assert margin < REL_MARGIN and tok == int(top2.indices[pos, 1]), (
            f"{label}: token {pos} is {tok}, transformers' greedy choice is {best} with a "
            f"top-2 margin of {margin:.2e} (a divergence is accepted only below {REL_MARGIN})")
        ties += 1
    return ties


def run_equality(model_dir, llm_factory, **engine_args):
    import transformers
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    engine_args.setdefault("block_size", BLOCK_SIZE)
    llm = llm_factory(model_dir, num_blocks=8192 // engine_args["block_size"], max_num_seqs=16,
                      **engine_args)
    prompts = mixed_prompts(ref_model.config.vocab_size)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    ties = 0
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        ours = out.outputs[0].token_ids
        assert out.outputs[0].finish_reason == "length" and len(ours) == NEW_TOKENS
        ties += count_near_tie_divergences(ours, hf_next_token_logits(ref_model, prompt, ours),
                                           f"prompt {i}")
    assert ties <= 2, f"{ties} near-tie divergences in {len(prompts)} prompts; logits look flat"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_maker_models_match_transformers(arch, tiny_model, llm_factory):
    run_equality(tiny_model(arch), llm_factory)


@pytest.mark.parametrize("kind", ["llama-gqa", "qwen2-tied", "qwen3", "llama3-rope",
                                  "llama-linear-rope", "mistral"])
def test_save_pretrained_models_match_transformers(kind, hf_saved_model, llm_factory):
    run_equality(hf_saved_model(kind), llm_factory)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_npu_backend_through_emulator_matches_transformers(arch, tiny_model, llm_factory,
                                                           npu_emulator):
    run_equality(tiny_model(arch), llm_factory, kernel_backend="npu", block_size=128)
