"""The tokenizer and chat template of a GGUF file (common/model/formats/gguf_tokenizer.py),
on tiny files: token for token equal to transformers' tokenizer of the same file, the
chat template rendered as transformers' apply_chat_template renders it, and the errors."""
from __future__ import annotations

import pytest

from common.model.formats.gguf_tokenizer import PRE_TOKENIZERS
from common.model.tokenizer import Tokenizer, TokenizerError
from services.gateway.openai_http.chat_template import ChatTemplate
from tests.gguf_files import CORPUS, TOKENS, hf_tiny_llama, write_tiny_llama

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "caf\u00e9 \u4f60\u597d"}],
]


@pytest.fixture(scope="module")
def gguf_with_pre(tmp_path_factory):
    model = hf_tiny_llama(seed=0)
    folder = tmp_path_factory.mktemp("gguf-tok")
    return lambda pre, **kw: write_tiny_llama(folder / f"{pre}-{len(kw)}.gguf", model, pre=pre, **kw)


@pytest.mark.parametrize("pre", ["gpt-2", "llama-bpe"])
def test_encode_equals_transformers(pre, gguf_with_pre):
    import transformers
    path = gguf_with_pre(pre)
    ref = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ours = Tokenizer.from_dir(path)
    for text in CORPUS:
        ids = ours.encode(text)
        assert ids == ref.encode(text), text
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False), text
    assert ours.vocab_size == len(TOKENS) and ours.all_special_ids == [0, 1, 2]
    assert (ours.bos_token_id, ours.eos_token_ids, ours.pad_token_id) == (1, [2, 0], 2)


def test_smollm_splits_every_digit(gguf_with_pre):
    """tokenizer.ggml.pre "smollm" is SmolLM2's tokenizer.json (Digits(individual) before
    GPT-2's split), as llama.cpp's smollm pre-tokenizer: the vocabulary's "12" and "123"
    merges never apply (transformers, which knows no "smollm", would use them)."""
    tok = Tokenizer.from_dir(gguf_with_pre("smollm"))
    assert tok.encode("123 x") == [TOKENS.index(c) for c in ("1", "2", "3", "Ġ", "x")]
    assert Tokenizer.from_dir(gguf_with_pre("gpt-2")).encode("123") == [TOKENS.index("123")]


def test_chat_template_equals_transformers(gguf_with_pre):
    import transformers
    path = gguf_with_pre("gpt-2")
    ref = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ours = ChatTemplate.from_dir(path)
    assert ours.special_tokens == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
                                   "pad_token": "<|im_end|>", "unk_token": ""}
    for messages in CONVERSATIONS:
        for gen in (True, False):
            assert ours.render(messages, add_generation_prompt=gen) == ref.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=gen)


def test_missing_tokenizer_is_named(gguf_with_pre):
    path = gguf_with_pre("gpt-2", tokenizer=False)
    with pytest.raises(TokenizerError, match=r"the GGUF file has no tokenizer: metadata key "
                                             r"'tokenizer.ggml.model' is missing") as e:
        Tokenizer.from_dir(path)
    assert str(path) in str(e.value)
    assert ChatTemplate.from_dir(path) is None


def test_unknown_pre_tokenizer_names_the_known_ones(gguf_with_pre):
    with pytest.raises(TokenizerError, match=r"tokenizer.ggml.pre='qwen9' is not supported; known: "
                                             + repr(sorted(PRE_TOKENIZERS)).replace("[", r"\[").replace("]", r"\]")):
        Tokenizer.from_dir(gguf_with_pre("qwen9"))
