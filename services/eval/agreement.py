"""Agreement and KL between a model A and a reference B, teacher-forced on the same
prompts, from full distributions in this process (LLM.prompt_logprobs_full):

    agreement = mean over positions of [argmax A == argmax B]
    kl        = mean over positions of KL(B || A) = sum_v pB(v) (log pB(v) - log pA(v))

A position is a prompt position predicting the next prompt token (len - 1 a prompt).
Both models must have the same vocabulary size (ValueError naming it).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Agreement:
    agreement: float
    kl: float            # mean KL(B || A), nats
    positions: int
    num_prompts: int


def agreement(llm_a, llm_b, prompts: list[list[int]]) -> Agreement:
    """A = llm_a, B = llm_b (LLMs; the same one is allowed); float64 sums."""
    import torch
    vocab_a, vocab_b = llm_a.engine.vocab_size, llm_b.engine.vocab_size
    if vocab_a != vocab_b:
        raise ValueError(f"the models' vocab_size must match: {vocab_a} (model) != {vocab_b} (reference)")
    agree, kl, positions = 0, 0.0, 0
    for ids in prompts:
        a = llm_a.prompt_logprobs_full(ids)
        b = a if llm_b is llm_a else llm_b.prompt_logprobs_full(ids)
        agree += int((a.argmax(dim=-1) == b.argmax(dim=-1)).sum())
        kl += float(torch.nn.functional.kl_div(a, b, reduction="none", log_target=True).sum(dim=-1).double().sum())
        positions += a.shape[0]
    return Agreement(agree / positions, kl / positions, positions, len(prompts))
