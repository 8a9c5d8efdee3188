"""Incremental detokenization: token ids in, text deltas out, never half a character.

Two paths, chosen by the tokenizer:

1. Byte-level tokenizers (`tokenizer.is_byte_level`: Llama-3, Qwen2/3, the tiny models).
   Each id maps to fixed raw bytes (`tokenizer.token_bytes`), so a Python incremental
   UTF-8 decoder (errors="replace") holds an incomplete trailing character and emits the
   rest: O(bytes of the new ids) per call, no re-decoding at all. Its U+FFFD placement
   for invalid bytes is the same as tokenizers' (Rust from_utf8_lossy: maximal subparts).

2. Any other tokenizer (duck-typed: `decode(ids, skip_special_tokens)` and
   `all_special_ids`): vLLM-style offsets over the decodable ids, decoding a window:

    ids:  ... prompt tail | emitted ......... | pending (held by trailing U+FFFD)
                          ^prefix_offset      ^read_offset              ^len(ids)
                          |<-- decode(ids[prefix_offset:]) = window text ------>|

   Each add decodes the window, emits its text up to any trailing U+FFFD run (a
   character later bytes may finish), and when the text ends cleanly slides
   prefix_offset to read_offset and read_offset to the end. Decode work per token is the
   window size: small, but it grows over a run of tokens that all end mid-character
   (BPE tokens straddling CJK characters), until one ends on a character boundary.
   The prompt's last PROMPT_CONTEXT_TOKENS ids seed the window as left context, for
   decoders (e.g. Metaspace) whose output depends on the preceding token.

Skipped special ids are dropped before decoding: tokenizers' decode does the same.
Contract (byte-level path; also the window path for byte-level decoders and a prompt
that ends on a character boundary): "".join(every delta, flush()) ==
tokenizer.decode(output ids, skip_special_tokens) exactly, and no delta contains U+FFFD
unless the decoded text has one there. Not thread-safe; one instance per request.
"""
from __future__ import annotations

import codecs
from typing import Iterable, Sequence

from common.model.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5
_TRIM_IDS_AFTER = 4096


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
        self._ids: list[int] = context  # decodable ids; only [prefix_offset:] is read again
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._num_emitted = len(self._decode(context))  # chars of the window text already out

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
        self._ids.extend(decodable)
        return self._out(self._step(final=False))

    def flush(self) -> str:
        """Emit whatever is held back, an unfinished character as U+FFFD.

        Call once, when the request finishes: a character cut here stays cut.
        """
        if self._utf8 is not None:
            return self._out(self._utf8.decode(b"", final=True))
        return self._out(self._step(final=True))

    def _step(self, final: bool) -> str:
        text = self._decode(self._ids[self._prefix_offset:])
        stable_end = len(text) if final else len(text.rstrip(_REPLACEMENT))
        delta = text[self._num_emitted:stable_end] if stable_end > self._num_emitted else ""
        self._num_emitted = max(self._num_emitted, stable_end)
        if stable_end == len(text) and self._read_offset < len(self._ids):
            # Clean end on a token boundary: the new ids become the next window's prefix.
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            self._num_emitted = len(self._decode(self._ids[self._prefix_offset:]))
            if self._prefix_offset > _TRIM_IDS_AFTER:
                del self._ids[: self._prefix_offset]
                self._read_offset -= self._prefix_offset
                self._prefix_offset = 0
        return delta

    def _out(self, delta: str) -> str:
        if delta:
            self._chunks.append(delta)
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special) if ids else ""
