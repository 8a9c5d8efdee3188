"""Log-probabilities in the OpenAI API's two shapes, from the mesh's TokenLogprobs.

The mesh sends one TokenLogprobs per generated token (common.proto: the sampled token
first, then the model's top tokens, the sampled one not repeated). Here each becomes
    /v1/completions (`logprobs: N`), per choice or chunk:
        {"tokens": [str], "token_logprobs": [float], "top_logprobs": [{str: float}],
         "text_offset": [int]}
        top_logprobs: the N most likely tokens (a dict keyed by token text, as OpenAI's);
        text_offset: the summed lengths of the earlier tokens' texts, counted across a
        stream's chunks: where each token starts in the choice's text for byte-level
        tokenizers (GPT-2, Llama-3, Qwen), an approximation for SentencePiece ones, whose
        decoder drops a lone token's leading space
    /v1/chat/completions (`logprobs: true, top_logprobs: N`), per choice or chunk:
        {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
         "bytes"}] * N}]}
A token's text is the tokenizer's decoding of that token alone (special tokens kept); a
token that is part of a UTF-8 character decodes to U+FFFD, and `bytes` then holds its
raw bytes (byte-level tokenizers), as OpenAI's field is for.
"""
from __future__ import annotations

from protos.pdmesh.v1 import common_pb2
from common.model.tokenizer import Tokenizer


class TokenTexts:
    """Each token id's text and bytes, decoded once (safe to share: a dict fill is
    idempotent)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._text: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        cached = self._text.get(token_id)
        if cached is None:
            cached = self._text[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return cached

    def bytes(self, token_id: int) -> list[int]:
        text = self.text(token_id)
        if self.tokenizer.is_byte_level and "\ufffd" in text:
            return list(self.tokenizer.token_bytes(token_id))
        return list(text.encode("utf-8"))


def top(entry: common_pb2.TokenLogprobs, n: int) -> list[tuple[int, float]]:
    """The n most likely (token id, logprob) of one position, most likely first."""
    pairs = sorted(zip(entry.token_ids, entry.logprobs), key=lambda p: -p[1])
    return pairs[:n]


class CompletionLogprobs:
    """The `logprobs` objects of one /v1/completions choice, chunk after chunk."""

    def __init__(self, texts: TokenTexts, num_top: int):
        self.texts, self.num_top = texts, num_top
        self.offset = 0

    def of(self, entries) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for entry in entries:
            text = self.texts.text(entry.token_ids[0])
            out["tokens"].append(text)
            out["token_logprobs"].append(entry.logprobs[0])
            out["top_logprobs"].append({self.texts.text(t): lp for t, lp in top(entry, self.num_top)})
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out


class ChatLogprobs:
    """The `logprobs` objects of a /v1/chat/completions choice or chunk."""

    def __init__(self, texts: TokenTexts, num_top: int):
        self.texts, self.num_top = texts, num_top

    def _token(self, token_id: int, logprob: float) -> dict:
        return {"token": self.texts.text(token_id), "logprob": logprob, "bytes": self.texts.bytes(token_id)}

    def of(self, entries) -> dict:
        return {"content": [{**self._token(e.token_ids[0], e.logprobs[0]),
                             "top_logprobs": [self._token(t, lp) for t, lp in top(e, self.num_top)]}
                            for e in entries]}
