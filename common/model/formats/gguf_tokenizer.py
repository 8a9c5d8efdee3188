"""The tokenizer and chat template stored in a GGUF file's metadata.

    tokenizer.ggml.model        "gpt2" (byte-level BPE) is the one supported
    tokenizer.ggml.pre          the pre-tokenizer (how text is split before BPE): PRE_TOKENIZERS
    tokenizer.ggml.tokens       the vocabulary, in id order, in the byte-level spelling
    tokenizer.ggml.merges       "left right" pairs, best first
    tokenizer.ggml.token_type   1 normal, 3 control (-> special added token), 4 user-defined
                                (-> added token, not special)
    tokenizer.ggml.{bos,eos,eot,eom,padding,unknown}_token_id, add_bos_token, add_eos_token
    tokenizer.chat_template     the jinja chat template

`build_tokenizer(file)` makes the `tokenizers.Tokenizer` that a tokenizer.json of the same
model would describe; it encodes as transformers' tokenizer of the GGUF does
(AutoTokenizer.from_pretrained(dir, gguf_file=...)): a token outside the byte alphabet is
respelled byte by byte, and a control token outside it is not made special (llama.cpp
mislabels some). `tokenizer_config(file)` is the matching tokenizer_config.json.
A file without a tokenizer, or with one of another kind, is a TokenizerError (ValueError)
naming the file and the key.
"""
from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from common.model.formats.gguf_reader import GGUFFile
from common.model.tokenizer import _UNICODE_TO_BYTE, TokenizerError

CONTROL, USER_DEFINED = 3, 4
TOKENIZER_MODELS = ("gpt2",)
# texts that end a turn in llama.cpp's chat formats (it treats them as end-of-generation)
EOG_TEXTS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|endoftext|>", "<|end|>", "<end_of_turn>",
             "<|end_of_text|>")

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _byte_level(use_regex: bool = True) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=use_regex)


def _split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                                    _byte_level(use_regex=False)])


# tokenizer.ggml.pre -> a factory of its pre-tokenizer
PRE_TOKENIZERS = {
    "gpt-2": _byte_level,
    # SmolLM/SmolLM2: every digit alone, then GPT-2's split (its tokenizer.json)
    "smollm": lambda: pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _byte_level()]),
    "llama-bpe": lambda: _split_then_bytes(_LLAMA3_SPLIT),
    "llama3": lambda: _split_then_bytes(_LLAMA3_SPLIT),
}

_BYTE_TO_UNICODE = {b: c for c, b in _UNICODE_TO_BYTE.items()}


def _spelled(token: str) -> str:
    """A token in the byte-level alphabet: as it is, or its UTF-8 bytes respelled."""
    if all(c in _UNICODE_TO_BYTE for c in token):
        return token
    return "".join(_BYTE_TO_UNICODE[b] for b in token.encode("utf-8"))


def _need(file: GGUFFile, key: str) -> Any:
    if key not in file.metadata:
        raise TokenizerError(f"{file.path}: the GGUF file has no tokenizer: metadata key {key!r} is missing")
    return file.metadata[key]


def build_tokenizer(file: GGUFFile) -> Tokenizer:
    """The byte-level BPE tokenizer of the file (see the module docstring)."""
    kind = _need(file, "tokenizer.ggml.model")
    if kind not in TOKENIZER_MODELS:
        raise TokenizerError(f"{file.path}: tokenizer.ggml.model={kind!r} is not supported; "
                             f"allowed: {list(TOKENIZER_MODELS)}")
    pre = file.get("tokenizer.ggml.pre", "gpt-2")
    if pre not in PRE_TOKENIZERS:
        raise TokenizerError(f"{file.path}: tokenizer.ggml.pre={pre!r} is not supported; "
                             f"known: {sorted(PRE_TOKENIZERS)}")
    tokens = _need(file, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in _need(file, "tokenizer.ggml.merges")]
    token_types = file.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {_spelled(t): i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tok.decoder = decoders.ByteLevel()
    in_alphabet = [all(c in _UNICODE_TO_BYTE for c in t) for t in tokens]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind, ok in zip(tokens, token_types, in_alphabet) if kind == CONTROL and ok])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, kind, ok in zip(tokens, token_types, in_alphabet) if kind == USER_DEFINED and ok])
    tok.post_processor = _post_processor(file, tokens)
    return tok


def _post_processor(file: GGUFFile, tokens: list[str]) -> processors.TemplateProcessing:
    single, pair, special = ["$A"], ["$A", "$B:1"], []
    for side, flag, key in (("bos", "add_bos_token", "bos_token_id"), ("eos", "add_eos_token", "eos_token_id")):
        token_id = file.get(f"tokenizer.ggml.{key}")
        if file.get(f"tokenizer.ggml.{flag}", False) and token_id is not None:
            text = tokens[token_id]
            special.append((text, token_id))
            single = [text, *single] if side == "bos" else [*single, text]
            pair = [text, *pair] if side == "bos" else [*pair, f"{text}:1"]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def eog_token_ids(metadata: dict[str, Any]) -> list[int]:
    """End-of-generation ids: eos, eot and eom ids of the metadata, then every control
    token whose text is one of EOG_TEXTS (e.g. ChatML's <|im_end|>); no duplicates."""
    ids = [metadata.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    types = metadata.get("tokenizer.ggml.token_type") or []
    ids += [i for i, (t, kind) in enumerate(zip(tokens, types)) if kind == CONTROL and t in EOG_TEXTS]
    return list(dict.fromkeys(int(i) for i in ids if i is not None))


def special_token_ids(file: GGUFFile) -> dict[str, Any]:
    """bos_token_id, eos_token_ids, pad_token_id as common.model.tokenizer.Tokenizer takes them."""
    return {"bos_token_id": file.get("tokenizer.ggml.bos_token_id"),
            "eos_token_ids": eog_token_ids(file.metadata),
            "pad_token_id": file.get("tokenizer.ggml.padding_token_id")}


def tokenizer_config(file: GGUFFile) -> dict[str, Any]:
    """The HF tokenizer_config.json of the file: chat_template (when it has one), the
    special tokens as strings (None when unset), add_bos_token / add_eos_token."""
    tokens = file.get("tokenizer.ggml.tokens") or []

    def text(key: str) -> str | None:
        token_id = file.get(f"tokenizer.ggml.{key}")
        return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None

    cfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": text("bos_token_id"), "eos_token": text("eos_token_id"),
        "pad_token": text("padding_token_id"), "unk_token": text("unknown_token_id"),
        "add_bos_token": bool(file.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(file.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
    }
    arch = file.get("general.architecture")
    if f"{arch}.context_length" in file.metadata:
        cfg["model_max_length"] = int(file.metadata[f"{arch}.context_length"])
    if isinstance(file.get("tokenizer.chat_template"), str):
        cfg["chat_template"] = file.metadata["tokenizer.chat_template"]
    return cfg
