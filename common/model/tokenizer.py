"""Tokenizer of a Hugging Face model folder, on the `tokenizers` library only.

`Tokenizer.from_dir(model_dir)` reads tokenizer.json (required) and, when present,
tokenizer_config.json, config.json and generation_config.json; given a .gguf file, it
builds the same from the file's metadata (common/model/formats/gguf_tokenizer.py). It
never imports transformers, so encode/decode are exactly `tokenizers.Tokenizer.encode/decode`:
whether a bos token is prepended is decided by tokenizer.json's post-processor, as in HF
fast tokenizers (Llama-3: yes; Qwen2/Qwen3: no bos at all).

Special ids:
    bos_token_id   tokenizer_config.json "bos_token" (a string or an AddedToken dict;
                   null -> None) when the key is present, else config.json bos_token_id.
    eos_token_ids  union, in this order, of generation_config.json eos_token_id,
                   config.json eos_token_id (each an int or a list) and
                   tokenizer_config.json "eos_token"; duplicates dropped.
    pad_token_id   tokenizer_config.json "pad_token" (None if not in the vocabulary),
                   else config.json pad_token_id.
A bos/eos token named in tokenizer_config.json but absent from the vocabulary raises
TokenizerError. Instances are immutable after construction (token_bytes only fills an
idempotent cache) and safe to share between threads.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Sequence

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders

from common.model.formats import is_gguf


class TokenizerError(ValueError):
    """A tokenizer file is missing or cannot be parsed; the message names the file."""


class Tokenizer:
    """Byte-exact wrapper around one `tokenizers.Tokenizer` plus the model's special ids."""

    def __init__(
        self,
        tokenizer: _HFTokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_ids: Sequence[int] = (),
        pad_token_id: int | None = None,
    ) -> None:
        self._tok = tokenizer
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        self.eos_token_ids: list[int] = list(dict.fromkeys(eos_token_ids))
        self.pad_token_id = pad_token_id
        added = tokenizer.get_added_tokens_decoder()
        self.all_special_ids: list[int] = sorted(i for i, t in added.items() if t.special)
        # With a plain ByteLevel decoder, decode(ids) == utf8_lossy(b"".join(token_bytes)).
        self.is_byte_level: bool = isinstance(tokenizer.decoder, decoders.ByteLevel)
        self._token_bytes: dict[int, bytes] = {}

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "Tokenizer":
        """Load from a HF model folder, or a .gguf file (its tokenizer.ggml.* metadata,
        common/model/formats/gguf_tokenizer.py). Raises TokenizerError naming the bad file."""
        root = Path(model_dir)
        if is_gguf(root):
            return cls._from_gguf(root)
        path = root / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{path}: tokenizer.json not found (only HF fast tokenizers are supported)")
        try:
            tok = _HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises plain Exception on parse errors
            raise TokenizerError(f"{path}: cannot load tokenizer.json: {e}") from e
        tok_cfg = _read_json(root / "tokenizer_config.json")
        model_cfg = _read_json(root / "config.json")
        gen_cfg = _read_json(root / "generation_config.json")

        def token_id(field: str, strict: bool = True) -> int | None:
            content = _token_content(tok_cfg.get(field))
            if content is None:
                return None
            token_id = tok.token_to_id(content)
            if token_id is None and strict:
                raise TokenizerError(f"{root / 'tokenizer_config.json'}: {field} {content!r} is not in the vocabulary")
            return token_id

        bos = token_id("bos_token") if "bos_token" in tok_cfg else model_cfg.get("bos_token_id")
        eos_ids = [*_id_list(gen_cfg.get("eos_token_id")), *_id_list(model_cfg.get("eos_token_id"))]
        eos_from_tok = token_id("eos_token")
        if eos_from_tok is not None:
            eos_ids.append(eos_from_tok)
        pad = token_id("pad_token", strict=False) if "pad_token" in tok_cfg else model_cfg.get("pad_token_id")
        return cls(tok, bos_token_id=bos, eos_token_ids=eos_ids, pad_token_id=pad)

    @classmethod
    def _from_gguf(cls, path: Path) -> "Tokenizer":
        from common.model.formats.gguf_reader import read_gguf
        from common.model.formats.gguf_tokenizer import build_tokenizer, special_token_ids
        file = read_gguf(path)
        return cls(build_tokenizer(file), **special_token_ids(file))

    @property
    def backend(self) -> _HFTokenizer:
        """The wrapped tokenizers.Tokenizer (read-only use)."""
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; add_special_tokens runs the post-processor (e.g. bos)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; invalid UTF-8 byte runs decode to U+FFFD."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string of `token_id` (byte-level form), None if out of range."""
        return self._tok.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def token_bytes(self, token_id: int) -> bytes:
        """Raw bytes the ByteLevel decoder makes of `token_id` (b"" if out of range).

        Only meaningful when is_byte_level. Mirrors tokenizers' ByteLevel decoder: every
        char of the token string maps back to one byte; a token with any char outside
        the byte alphabet (an added token such as "中文") is taken as its own UTF-8.
        """
        cached = self._token_bytes.get(token_id)
        if cached is None:
            token = self._tok.id_to_token(token_id)
            if token is None:
                cached = b""
            elif all(c in _UNICODE_TO_BYTE for c in token):
                cached = bytes(_UNICODE_TO_BYTE[c] for c in token)
            else:
                cached = token.encode("utf-8")
            self._token_bytes[token_id] = cached
        return cached

    def __len__(self) -> int:
        return self.vocab_size


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in char for each byte (tokenizers' ByteLevel), inverted."""
    byte_values = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in byte_values}
    num_shifted = 0
    for b in range(256):
        if b not in byte_values:  # control chars, space, etc.: U+0100, U+0101, ... in order
            table[chr(256 + num_shifted)] = b
            num_shifted += 1
    return table


_UNICODE_TO_BYTE = _byte_level_alphabet()


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise TokenizerError(f"{path}: invalid JSON: {e}") from e
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_content(value: object) -> str | None:
    """A special token given as a string or an AddedToken dict ({"content": ...})."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _id_list(value: object) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]  # type: ignore[union-attr]


def tokenizer_or_none(model_dir: str | Path) -> Tokenizer | None:
    """The folder's tokenizer, or None when it has none (an engine used with token ids only)."""
    try:
        return Tokenizer.from_dir(model_dir)
    except (FileNotFoundError, ValueError):
        return None
