"""services/gateway/openai_http/chat_template.py renders exactly what transformers'
apply_chat_template renders (the tiny models' templates and one with every whitespace
control), token for token; the sandbox holds; raise_exception is the request's fault."""
from __future__ import annotations

import json

import pytest

from common.model.tokenizer import Tokenizer
from services.gateway.openai_http.chat_template import ChatTemplate, TemplateError

CONVERSATIONS = [
    [{"role": "user", "content": "Hello there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Two colours?"},
     {"role": "assistant", "content": "Red, blue."}, {"role": "user", "content": "  One more  "}],
]
# trim_blocks / lstrip_blocks / {%- -%}, a namespace, loop.first, filters, tojson of non-ASCII
INDENTED = """{%- set ns = namespace(system='') -%}
{% for message in messages %}
    {% if message['role'] == 'system' %}
        {% set ns.system = message['content'] %}
    {% endif %}
{% endfor %}
{{ bos_token }}
{% if ns.system %}[SYS] {{ ns.system }} [/SYS]
{% endif %}
{% for message in messages if message['role'] != 'system' %}
    {% if loop.first and message['role'] != 'user' %}{{ raise_exception('the first message must be the user') }}{% endif %}
    <{{ message['role'] }}> {{ message['content'] | trim }}{{ eos_token if message['role'] == 'assistant' }}
{% endfor %}
{% if add_generation_prompt %}<assistant>{% endif %}
{{ {'note': 'café'} | tojson }}"""


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_dir(request, tiny_model):
    return tiny_model(request.param)


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_tiny_model_template_renders_as_transformers(model_dir, hf_tokenizer, messages, add_generation_prompt):
    template = ChatTemplate.from_dir(model_dir)
    text = template.render(messages, add_generation_prompt)
    assert text == hf_tokenizer.apply_chat_template(messages, tokenize=False,
                                                    add_generation_prompt=add_generation_prompt)
    ids = Tokenizer.from_dir(model_dir).encode(text, add_special_tokens=False)
    hf_ids = hf_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    assert ids == list(getattr(hf_ids, "input_ids", hf_ids))


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_whitespace_control_and_filters_render_as_transformers(model_dir, hf_tokenizer, messages):
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    ours = ChatTemplate(INDENTED, {"bos_token": config["bos_token"] or "", "eos_token": config["eos_token"]})
    want = hf_tokenizer.apply_chat_template(messages, chat_template=INDENTED, tokenize=False,
                                            add_generation_prompt=True)
    assert ours.render(messages, True) == want
    assert want.endswith('{"note": "café"}')


def test_raise_exception_and_a_failing_template_are_template_errors():
    template = ChatTemplate(INDENTED, {"bos_token": "<s>"})
    with pytest.raises(TemplateError, match="the first message must be the user"):
        template.render([{"role": "assistant", "content": "hi"}])
    with pytest.raises(TemplateError, match="failed on these messages"):
        ChatTemplate("{{ messages[0]['content'] + 1 }}").render([{"role": "user", "content": "x"}])
    with pytest.raises(TemplateError, match="does not parse"):
        ChatTemplate("{% for %}")


@pytest.mark.parametrize("source", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__init__.__globals__ }}",
    "{{ messages.append(1) }}",                       # immutable: no mutation of the inputs
    "{% set _ = messages[0].update({'role': 'x'}) %}",
    "{{ cycler.__init__.__globals__.os.system('true') }}",
])
def test_the_sandbox_refuses_python_internals_and_mutation(source):
    messages = [{"role": "user", "content": "x"}]
    with pytest.raises(TemplateError):
        ChatTemplate(source).render(messages)
    assert messages == [{"role": "user", "content": "x"}]


def test_from_dir_reads_the_named_default_and_none_without_a_template(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<s>"}, "eos_token": "</s>",
        "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "{{ bos_token }}D"}]}))
    assert ChatTemplate.from_dir(tmp_path).render([]) == "<s>D"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    assert ChatTemplate.from_dir(tmp_path) is None
    (tmp_path / "chat_template.jinja").write_text("{{ eos_token }}J")
    assert ChatTemplate.from_dir(tmp_path).render([]) == "</s>J"
