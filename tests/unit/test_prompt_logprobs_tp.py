"""Prompt logprobs at tensor parallelism 2: the score rows travel in the step's inputs,
so every rank computes the same logits slices (the vocab-parallel head's gather is a
collective); the result equals transformers', across chunks and slices."""
from __future__ import annotations

import random

import torch

from common.config import EngineConfig
from common.engine import SamplingParams
from common.engine.llm_engine import LLMEngine
from tests.conftest import BLOCK_SIZE, assert_no_blocks_in_use

TOL = 2e-4


def test_prompt_logprobs_at_tp2_equal_transformers(hf_saved_model):
    import transformers
    model_dir = hf_saved_model("llama-gqa")
    ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rng = random.Random(3)
    long_prompt = [rng.randrange(3, 1024) for _ in range(600)]   # chunks of 300: slices 256 + 44 twice
    short_prompt = [rng.randrange(3, 1024) for _ in range(40)]
    engine = LLMEngine(EngineConfig(str(model_dir), num_blocks=128, block_size=BLOCK_SIZE, max_num_seqs=4,
                                    max_num_batched_tokens=300, tensor_parallel_size=2))
    try:
        full = torch.empty(len(short_prompt) - 1, 1024)

        def sink(start: int, rows: torch.Tensor) -> None:
            full[start:start + rows.shape[0]] = rows

        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
        engine.add_request("tp-long", long_prompt, params)
        engine.add_request("tp-short", short_prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                           prompt_sink=sink)
        got = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.prompt_logprobs is not None:
                    got[out.request_id] = out.prompt_logprobs
        assert list(got) == ["tp-long"]
        with torch.inference_mode():
            logp = ref(torch.tensor([long_prompt])).logits[0, :-1].float().log_softmax(-1)
            short_ref = ref(torch.tensor([short_prompt])).logits[0, :-1].float().log_softmax(-1)
        entries = got["tp-long"]
        assert len(entries) == 600 and entries[0] is None
        for p in range(1, 600):
            top = logp[p - 1].topk(2).indices.tolist()
            assert set(entries[p]) == {long_prompt[p], *top}, f"position {p}"
            for t, v in entries[p].items():
                assert abs(v - float(logp[p - 1, t])) < TOL, f"position {p}, token {t}"
        assert float((full - short_ref).abs().max()) < TOL
        assert_no_blocks_in_use(engine)
    finally:
        engine.close()
