"""Incremental detokenization: token ids in, text deltas out, never half a character.

Two paths, chosen by the tokenizer:

1. Byte-level tokenizers (`tokenizer.is_byte_level`: Llama-3, Qwen2/3, the tiny models).
   Each id maps to fixed raw bytes (`tokenizer.token_bytes`), so Python's incremental
   UTF-8 decoder (errors="replace") holds an incomplete trailing character and emits the
   rest: O(bytes of the new ids) per call, no re-decoding at all. Its U+FFFD placement
   for invalid bytes is the same as tokenizers' (Rust from_utf8_lossy: maximal subparts).

2. Any other tokenizer (SentencePiece-style decoders such as Metaspace, byte fallback):
   tokenizers' own `DecodeStream`, which keeps the prefix / read offsets over the ids
   (the scheme vLLM and TGI use) in Rust and returns nothing while the ids end inside a
   character. The prompt's last PROMPT_CONTEXT_TOKENS ids seed it as left context, for
   decoders whose output depends on the preceding token. `flush` decodes the whole
   output once to emit what the stream still holds.

Skipped special ids are dropped before decoding: tokenizers' decode does the same.
Contract (byte-level path; also the stream path for a prompt that ends on a character
boundary): "".join(every delta, flush()) == tokenizer.decode(output ids,
skip_special_tokens) exactly, and no delta contains U+FFFD unless the decoded text has
one there. Not thread-safe; one instance per request.
"""
from __future__ import annotations

import codecs
from typing import Iterable, Sequence

from tokenizers.decoders import DecodeStream

from common.model.tokenizer import Tokenizer

PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a request's output ids into text, a delta per `add` call."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._skipped_ids = frozenset(tokenizer.all_special_ids) if skip_special_tokens else frozenset()
        self._chunks: list[str] = []
        self.token_ids: list[int] = []  # every output id passed to add(), specials included
        self._utf8 = None
        if getattr(tokenizer, "is_byte_level", False):
            self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
            return
        context = [i for i in prompt_token_ids if i not in self._skipped_ids][-PROMPT_CONTEXT_TOKENS:]
        self._context = context
        self._decodable: list[int] = []   # output ids the stream was given
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)

    @property
    def text(self) -> str:
        """All text emitted so far (the concatenation of the returned deltas)."""
        if len(self._chunks) > 1:
            self._chunks[:] = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def add(self, token_ids: Iterable[int]) -> str:
        """Append output ids; return the newly completed text ("" if none yet)."""
        new_ids = list(token_ids)
        self.token_ids.extend(new_ids)
        decodable = [i for i in new_ids if i not in self._skipped_ids]
        if not decodable:
            return ""
        if self._utf8 is not None:
            data = b"".join(self._tokenizer.token_bytes(i) for i in decodable)
            return self._out(self._utf8.decode(data))
        self._decodable.extend(decodable)
        backend = self._tokenizer.backend
        chunks = [self._stream.step(backend, i) for i in decodable]
        return self._out("".join(c for c in chunks if c))

    def flush(self) -> str:
        """Emit whatever is held back, an unfinished character as U+FFFD.

        Call once, when the request finishes: a character cut here stays cut.
        """
        if self._utf8 is not None:
            return self._out(self._utf8.decode(b"", final=True))
        if not self._decodable:
            return ""
        prefix = self._decode(self._context)
        whole = self._decode(self._context + self._decodable)
        out = whole[len(prefix):] if whole.startswith(prefix) else self._decode(self._decodable)
        emitted = self.text
        return self._out(out[len(emitted):] if out.startswith(emitted) else "")

    def _out(self, delta: str) -> str:
        if delta:
            self._chunks.append(delta)
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special) if ids else ""
