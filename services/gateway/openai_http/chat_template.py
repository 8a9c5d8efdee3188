"""A model's chat template (tokenizer_config.json "chat_template"), rendered the way
transformers' `apply_chat_template` renders it:

  jinja2's ImmutableSandboxedEnvironment (a template cannot reach Python objects or
  mutate its inputs), trim_blocks + lstrip_blocks, the loopcontrols extension;
  `tojson` without ASCII escaping, `raise_exception(message)` and `strftime_now(format)`
  as globals; variables: messages, add_generation_prompt, tools (None), the special
  tokens of tokenizer_config.json (bos_token, eos_token, pad_token, unk_token, as their
  strings; "" when unset), and the caller's extra kwargs.
A template that raises (raise_exception, or a jinja error such as an undefined filter)
is a TemplateError: the request's fault (messages the template refuses), a 400.

The rendered text already holds the model's special tokens (bos, role markers): it is
tokenized without adding special tokens, as apply_chat_template(tokenize=True) does.
Instances are immutable and safe to share; render() is pure CPU work of microseconds to
milliseconds for prompts within limits.max_prompt_bytes.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from common.model.formats import is_gguf

SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")


class TemplateError(ValueError):
    """The template refused the messages, or failed on them; the message says why."""


def _raise_exception(message: str):
    raise TemplateError(message)


def _tojson(value, indent=None, separators=None, sort_keys=False, ensure_ascii=False):
    return json.dumps(value, indent=indent, separators=separators, sort_keys=sort_keys, ensure_ascii=ensure_ascii)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _token_text(value) -> str:
    """A special token of tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str] | None = None):
        """source: the jinja template; special_tokens: e.g. {"bos_token": "<s>"}.
        TemplateError if the template does not parse."""
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise TemplateError(f"the model's chat template does not parse: {e}") from None
        self.special_tokens = {name: "" for name in SPECIAL_TOKENS} | dict(special_tokens or {})
        # what render() sets itself; a caller's keyword of the same name would collide
        self.reserved_names = frozenset({"messages", "add_generation_prompt", *self.special_tokens})

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ChatTemplate | None":
        """The template of a HF model folder: tokenizer_config.json "chat_template" (a
        string, or a list of {"name", "template"} of which "default" is taken), else a
        chat_template.jinja file beside it; None when the model has none. A .gguf file:
        its tokenizer.chat_template (common/model/formats/gguf_tokenizer.py)."""
        root = Path(model_dir)
        if is_gguf(root):
            from common.model.formats.gguf_reader import read_gguf
            from common.model.formats.gguf_tokenizer import tokenizer_config
            config = tokenizer_config(read_gguf(root))
        else:
            try:
                config = json.loads((root / "tokenizer_config.json").read_text(encoding="utf-8"))
            except (OSError, ValueError):
                config = {}
        source = config.get("chat_template")
        if isinstance(source, list):
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default") or next(iter(named.values()), None)
        if not isinstance(source, str) and (root / "chat_template.jinja").is_file():
            source = (root / "chat_template.jinja").read_text(encoding="utf-8")
        if not isinstance(source, str) or not source:
            return None
        return cls(source, {name: _token_text(config.get(name)) for name in SPECIAL_TOKENS})

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """The prompt text for messages ([{"role", "content", ...}]). TemplateError when
        the template raises."""
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         tools=kwargs.pop("tools", None), **self.special_tokens, **kwargs)
        except TemplateError:
            raise
        except Exception as e:   # jinja2's errors, or e.g. a TypeError on an unexpected content
            raise TemplateError(f"the model's chat template failed on these messages: {e}") from None
