"""Deterministic byte-level BPE tokenizers for tiny test models.

Two flavours, mirroring the real families (regex Split, then ByteLevel without regex):
- "llama": Llama-3's split regex; specials <unk>=0, <s>=1 (bos, prepended by a
  TemplateProcessing post-processor), </s>=2 (eos) at the start of the vocabulary.
- "qwen":  NFC normalizer and Qwen2's split regex (exactly what transformers'
  Qwen2Tokenizer rebuilds); no bos; specials <|endoftext|>, <|im_start|>, <|im_end|>
  at the END of the vocabulary (the last three ids); ByteLevel post-processor.

`train_tiny_tokenizer` is a pure function of (flavour, vocab_size, text): training twice,
in the same or another process, gives the same tokenizer.json (checked by tests).
If the text cannot supply enough merges, the vocabulary is padded with special
"<|reserved_N|>" tokens (as Llama-3 does) so its size is exactly vocab_size.
"""
from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from common.model.tiny_corpus import CORPUS

FLAVOURS = ("llama", "qwen")
_LLAMA_SPECIALS = ("<unk>", "<s>", "</s>")
_QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MIN_VOCAB_SIZE = 256 + 3 + 16
# Pre-tokenizer split patterns of Llama-3 and Qwen2/Qwen3 (digits in runs of 1-3 vs 1).
_SPLIT_REGEX = {
    "llama": r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",
    "qwen": r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",
}


@dataclass(frozen=True)
class TinyTokenizer:
    """A trained tokenizer plus the special tokens the model folder must name."""

    tokenizer: Tokenizer
    bos_token: str | None
    eos_token: str
    pad_token: str | None
    add_bos_token: bool

    def token_id(self, token: str | None) -> int | None:
        return None if token is None else self.tokenizer.token_to_id(token)


def train_tiny_tokenizer(flavour: str, vocab_size: int, text: str = CORPUS) -> TinyTokenizer:
    """Train a byte-level BPE on `text`; the result has exactly `vocab_size` tokens."""
    if flavour not in FLAVOURS:
        raise ValueError(f"tokenizer flavour must be one of {FLAVOURS}, got {flavour!r}")
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be >= {MIN_VOCAB_SIZE} (256 bytes + specials + merges), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    if flavour == "qwen":
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT_REGEX[flavour]), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    leading = list(_LLAMA_SPECIALS) if flavour == "llama" else []
    trailing = [] if flavour == "llama" else list(_QWEN_SPECIALS)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(trailing),
        min_frequency=2,
        special_tokens=leading,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
    num_reserved = vocab_size - len(trailing) - tok.get_vocab_size(with_added_tokens=True)
    reserved = [f"<|reserved_{i}|>" for i in range(num_reserved)]
    if reserved or trailing:
        tok.add_special_tokens(reserved + trailing)
    assert tok.get_vocab_size(with_added_tokens=True) == vocab_size
    if flavour == "llama":
        bos_id = tok.token_to_id("<s>")
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B:1", special_tokens=[("<s>", bos_id)]
        )
        return TinyTokenizer(tok, bos_token="<s>", eos_token="</s>", pad_token=None, add_bos_token=True)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return TinyTokenizer(
        tok, bos_token=None, eos_token="<|endoftext|>", pad_token="<|endoftext|>", add_bos_token=False
    )


# Chat templates (tokenizer_config.json "chat_template", rendered by transformers'
# apply_chat_template and by the gateway's /v1/chat/completions): llama a plain
# "role: content" transcript after the bos token, qwen ChatML as the Qwen family's.
# Both refuse a role other than system / user / assistant through raise_exception.
_ROLE_CHECK = ("{% if message['role'] not in ['system', 'user', 'assistant'] %}"
               "{{ raise_exception('each message role must be system, user or assistant') }}{% endif %}")
CHAT_TEMPLATES = {
    "llama": ("{{ bos_token }}{% for message in messages %}" + _ROLE_CHECK
              + "{{ message['role'] + ': ' + message['content'] + '\n' }}{% endfor %}"
              "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"),
    "qwen": ("{% for message in messages %}" + _ROLE_CHECK
             + "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endfor %}"
             "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"),
}


def tokenizer_config(tiny: TinyTokenizer, model_max_length: int) -> dict:
    """The tokenizer_config.json dict HF AutoTokenizer needs for `tiny`, with its
    flavour's chat template."""
    added = {
        str(i): {
            "content": t.content, "lstrip": t.lstrip, "normalized": t.normalized,
            "rstrip": t.rstrip, "single_word": t.single_word, "special": t.special,
        }
        for i, t in sorted(tiny.tokenizer.get_added_tokens_decoder().items())
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": tiny.add_bos_token,
        "add_eos_token": False,
        "bos_token": tiny.bos_token,
        "eos_token": tiny.eos_token,
        "pad_token": tiny.pad_token,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "added_tokens_decoder": added,
        "chat_template": CHAT_TEMPLATES["qwen" if tiny.token_id("<|im_start|>") is not None else "llama"],
    }
