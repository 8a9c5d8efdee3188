"""common.model.tokenizer, common.model.detokenizer and the tiny BPE training."""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from common.model.detokenizer import IncrementalDetokenizer
from common.model.tiny import make_tiny_model
from common.model.tiny_corpus import CORPUS
from common.model.tiny_tokenizer import train_tiny_tokenizer
from common.model.tokenizer import Tokenizer, TokenizerError

SMALL = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
TEXTS = (
    "Hello, world! The quick brown fox jumps over 12345 lazy dogs.",
    "Le café était déjà fermé; Grüße aus München, señor.",
    "中文：今天天气很好。日本語とカタカナ。안녕하세요",
    "Emoji 🚀🎉 👩‍💻 🇫🇷 ❤️ and ∑√π",
    "  indented\n\ttabs\r\nand  double  spaces  ",
)
UNICODE_TEXT = "naïve café 🚀 中文测试 東京 🎉 Grüße ❤️ 한국어 👩‍💻 " * 20


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tok")
    return {arch: make_tiny_model(arch, root / arch, **SMALL) for arch in ("llama", "qwen2", "qwen3")}


@pytest.fixture(scope="module")
def toks(model_dirs) -> dict[str, Tokenizer]:
    return {arch: Tokenizer.from_dir(d) for arch, d in model_dirs.items()}


def test_training_is_deterministic_and_vocab_exact():
    a = train_tiny_tokenizer("qwen", 1024).tokenizer.to_str()
    assert a == train_tiny_tokenizer("qwen", 1024).tokenizer.to_str()
    assert a != train_tiny_tokenizer("qwen", 1024, text=CORPUS[:-200]).tokenizer.to_str()
    for flavour in ("llama", "qwen"):
        for vocab_size in (300, 1024, 3000):  # 3000 needs reserved tokens: the corpus runs out
            tok = train_tiny_tokenizer(flavour, vocab_size).tokenizer
            assert tok.get_vocab_size(with_added_tokens=True) == vocab_size
            assert len(set(tok.get_vocab().values())) == vocab_size
    tok = train_tiny_tokenizer("qwen", 1024).tokenizer
    texts = [tok.decode([i]) for i in range(tok.get_vocab_size())]
    whole_chars = [t for t in texts if "\ufffd" not in t and any(ord(c) >= 0x800 for c in t)]
    partial_chars = [t for t in texts if "\ufffd" in t]
    assert len(whole_chars) > 20 and len(partial_chars) > 128  # CJK merges; lone bytes
    with pytest.raises(ValueError, match="llama"):
        train_tiny_tokenizer("gpt2", 1024)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_roundtrip_and_bos(toks, arch):
    tok = toks[arch]
    for text in TEXTS:
        ids = tok.encode(text)
        plain = tok.encode(text, add_special_tokens=False)
        assert ids == ([1] + plain if arch == "llama" else plain)
        assert tok.decode(ids) == text
        assert all(0 <= i < tok.vocab_size for i in ids)
    assert len(tok.encode("中文")) < len("中文".encode())  # merged multi-byte tokens exist


def test_special_ids(toks):
    llama, qwen = toks["llama"], toks["qwen3"]
    assert (llama.vocab_size, llama.bos_token_id, llama.eos_token_ids, llama.all_special_ids) == (1024, 1, [2], [0, 1, 2])
    assert (qwen.vocab_size, qwen.bos_token_id, qwen.eos_token_ids) == (1024, None, [1023, 1021])
    assert qwen.all_special_ids == [1021, 1022, 1023] and qwen.pad_token_id == 1021
    assert [qwen.id_to_token(i) for i in qwen.all_special_ids] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert llama.id_to_token(10**6) is None
    ids = qwen.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1022 and ids[-1] == 1023
    assert qwen.decode(ids) == "user\nhi"
    assert qwen.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


def test_matches_hf_auto_tokenizer(model_dirs, toks):
    from transformers import AutoTokenizer

    for arch, d in model_dirs.items():
        hf = AutoTokenizer.from_pretrained(d)
        for text in (*TEXTS, CORPUS[:3000], "<|im_start|>x<|im_end|> <s>y</s>"):
            ids = toks[arch].encode(text)
            assert hf(text).input_ids == ids, (arch, text[:40])
            assert hf.decode(ids, skip_special_tokens=True) == toks[arch].decode(ids)
        assert (hf.bos_token_id, hf.eos_token_id) == (toks[arch].bos_token_id, toks[arch].eos_token_ids[-1])


def test_special_tokens_from_added_token_dicts_and_lists(model_dirs, tmp_path):
    d = Path(shutil.copytree(model_dirs["llama"], tmp_path / "m"))
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["bos_token"] = {"__type": "AddedToken", "content": "<s>", "lstrip": False, "special": True}
    cfg["eos_token"] = {"__type": "AddedToken", "content": "<unk>", "special": True}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 1]}))
    tok = Tokenizer.from_dir(d)
    assert (tok.bos_token_id, tok.eos_token_ids) == (1, [2, 1, 0])  # generation, config, tokenizer_config
    (d / "tokenizer_config.json").unlink()
    (d / "generation_config.json").unlink()
    assert (Tokenizer.from_dir(d).bos_token_id, Tokenizer.from_dir(d).eos_token_ids) == (1, [2])


def test_missing_or_broken_files_name_the_file(model_dirs, tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match=str(tmp_path / "tokenizer.json")):
        Tokenizer.from_dir(tmp_path)
    d = Path(shutil.copytree(model_dirs["qwen2"], tmp_path / "m"))
    (d / "tokenizer_config.json").write_text("[")
    with pytest.raises(TokenizerError, match="tokenizer_config.json"):
        Tokenizer.from_dir(d)


# ---- incremental detokenizer -------------------------------------------------------------

class _StreamOnly:
    """Hides token_bytes and is_byte_level, forcing the DecodeStream path; counts decodes."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok, self.all_special_ids, self.backend, self.decodes = tok, tok.all_special_ids, tok.backend, 0

    def decode(self, ids, skip_special_tokens=True):
        self.decodes += 1
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def _detok(tok: Tokenizer, path: str, **kw) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(tok if path == "bytes" else _StreamOnly(tok), **kw)  # type: ignore[arg-type]


def _stream(detok: IncrementalDetokenizer, ids: list[int], rng: random.Random) -> list[str]:
    deltas, pos = [], 0
    while pos < len(ids):
        n = rng.choice((1, 1, 1, 2, 3))
        deltas.append(detok.add(ids[pos:pos + n]))
        pos += n
    deltas.append(detok.flush())
    assert detok.token_ids == ids
    assert detok.text == "".join(deltas)
    return deltas


def _non_ascii_ids(tok: Tokenizer) -> list[int]:
    """Ids of tokens holding non-ASCII bytes, whole characters or parts of one."""
    return [i for i in range(tok.vocab_size) if i not in tok.all_special_ids
            and any(ord(c) >= 0x80 for c in tok.decode([i]))]


@pytest.mark.parametrize("path", ["bytes", "stream"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("skip", [True, False])
def test_deltas_concatenate_to_decode_on_random_streams(toks, arch, skip, path):
    tok = toks[arch]
    assert tok.is_byte_level
    rng = random.Random(f"{arch}-{skip}-{path}")
    non_ascii = _non_ascii_ids(tok)
    for trial in range(90):
        n = rng.randint(1, 120)
        if trial % 3 == 0:
            ids = [rng.randrange(tok.vocab_size) for _ in range(n)]
        elif trial % 3 == 1:
            ids = [rng.choice(non_ascii) if rng.random() < 0.8 else rng.choice(tok.all_special_ids) for _ in range(n)]
        else:  # valid text with specials sprinkled in
            ids = tok.encode(UNICODE_TEXT[rng.randrange(200):], add_special_tokens=False)[:n]
            for _ in range(rng.randint(0, 4)):
                ids.insert(rng.randint(0, len(ids)), rng.choice(tok.all_special_ids))
        deltas = _stream(_detok(tok, path, skip_special_tokens=skip), ids, rng)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip), ids


@pytest.mark.parametrize("path", ["bytes", "stream"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_unicode_never_broken(toks, arch, path):
    tok = toks[arch]
    rng = random.Random(arch)
    ids = tok.encode(UNICODE_TEXT, add_special_tokens=False)
    assert len(ids) > len(UNICODE_TEXT) // 3
    deltas = _stream(_detok(tok, path), ids, rng)
    assert "".join(deltas) == UNICODE_TEXT
    assert all("\ufffd" not in d for d in deltas)
    # every character split into single-byte tokens: still whole characters only, and
    # each one out as soon as its last byte is in
    byte_ids = [tok.token_to_id(c) for c in "".join(tok.id_to_token(i) for i in ids)]
    detok = _detok(tok, path)
    deltas = [detok.add([i]) for i in byte_ids] + [detok.flush()]
    assert "".join(deltas) == UNICODE_TEXT and all("\ufffd" not in d for d in deltas)
    assert sum(1 for d in deltas if d) == len(UNICODE_TEXT)


def test_unfinished_character_is_held_then_flushed(toks):
    tok = toks["qwen2"]
    byte_id = {tok.token_bytes(i): i for i in range(tok.vocab_size) if len(tok.token_bytes(i)) == 1}
    raw = "中".encode()
    detok = IncrementalDetokenizer(tok)
    assert detok.add(tok.encode("a中", add_special_tokens=False)) == "a中"
    assert detok.add([byte_id[raw[0:1]], byte_id[raw[1:2]]]) == ""
    assert detok.add([byte_id[raw[2:3]]]) == "中"
    assert detok.add([byte_id[raw[0:1]]]) == ""
    assert detok.flush() == "\ufffd"
    assert detok.text == "a中中\ufffd" == tok.decode(detok.token_ids)


@pytest.mark.parametrize("path", ["bytes", "stream"])
def test_prompt_context_is_not_emitted(toks, path):
    tok = toks["llama"]
    detok = _detok(tok, path, prompt_token_ids=tok.encode("Once upon a time 🚀"))
    out = tok.encode(" there was 中文 text.", add_special_tokens=False)
    assert "".join(_stream(detok, out, random.Random(0))) == " there was 中文 text."


def test_decode_work_per_token_is_bounded(toks):
    tok = toks["qwen2"]
    ids = tok.encode(UNICODE_TEXT * 5 + CORPUS, add_special_tokens=False)
    stream = ids[:2000] + [tok.all_special_ids[0]] * 500 + ids[2000:]
    streamed = _StreamOnly(tok)
    for t in (tok, streamed):
        detok = IncrementalDetokenizer(t)  # type: ignore[arg-type]
        for i in stream:
            detok.add([i])
        # the stream path never re-decodes per token: tokenizers' DecodeStream keeps the offsets
        assert streamed.decodes == 0
        detok.flush()
        assert detok.text == tok.decode(ids)


class _SentencePieceStyle:
    """A Llama-2-style tokenizer (BPE with byte fallback, Metaspace, the decoder chain of
    Llama-2's tokenizer.json), trained here: not byte-level, so the DecodeStream path."""

    def __init__(self) -> None:
        from tokenizers import Tokenizer as HF, decoders, models, normalizers, pre_tokenizers
        pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "▁",
                  *(chr(c) for c in range(33, 127)), "▁t", "he", "▁the", "re", "▁a"]
        merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("r", "e"), ("▁", "a")]
        backend = HF(models.BPE({p: i for i, p in enumerate(pieces)}, merges, byte_fallback=True, unk_token="<unk>"))
        backend.add_special_tokens(["<unk>", "<s>", "</s>"])
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=False)
        backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                             decoders.Strip(" ", 1, 0)])
        self.backend, self.all_special_ids = backend, [backend.token_to_id("<s>"), backend.token_to_id("</s>")]

    def decode(self, ids, skip_special_tokens=True):
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)


def test_a_sentencepiece_style_tokenizer_streams_whole_characters_and_its_spaces():
    tok = _SentencePieceStyle()
    text = "Once upon a time 中文 🚀 there was text."
    ids = tok.backend.encode(text).ids
    assert any(tok.backend.id_to_token(i).startswith("<0x") for i in ids)   # byte fallback in play
    for seed in range(5):
        detok = IncrementalDetokenizer(tok)  # type: ignore[arg-type]
        deltas = _stream(detok, ids, random.Random(seed))
        assert "".join(deltas) == tok.decode(ids) == text
        assert all("\ufffd" not in d for d in deltas)
    # after a prompt, the first output token's leading space is kept (Metaspace context)
    prompt = tok.backend.encode("Once upon a time").ids
    out = tok.backend.encode("Once upon a time there was").ids[len(prompt):]
    detok = IncrementalDetokenizer(tok, prompt_token_ids=prompt)  # type: ignore[arg-type]
    assert "".join(_stream(detok, out, random.Random(0))) == " there was"
