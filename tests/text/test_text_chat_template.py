"""Chat templates render exactly as transformers renders them, from every place a checkpoint keeps one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from app.text import ChatTemplate, Tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "  You answer in French.\n"},
        {"role": "user", "content": "Hello 👋, ça va ?"},
        {"role": "assistant", "content": "Oui, très bien. 😀"},
        {"role": "user", "content": "Et toi ?\n\n"},
    ],
    [{"role": "user", "content": [{"type": "text", "text": "Two "}, {"type": "text", "text": "parts."}]}],
    [{"role": "user", "content": "<|eot_id|> in user text", "name": None}],
]

# Templates in the style of real ones (written for these tests), using the constructs the Llama 3.x
# and Qwen templates use: namespace(), slicing, tojson with indent, strftime_now, loop controls,
# string methods, tools and tool calls, and keyword arguments such as enable_thinking.
LLAMA_STYLE = """\
{{- bos_token }}
{%- if not date_string is defined %}{%- set date_string = strftime_now("%Y") %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Date: " + date_string + "\\n" }}
{%- if tools is not none %}
    {{- "Tools:\\n" }}
    {%- for t in tools %}{{- t | tojson(indent=4) }}{{- "\\n\\n" }}{%- endfor %}
{%- endif %}
{{- system_message }}{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message.tool_calls is defined %}
        {%- set call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + call.name + '", "parameters": ' + call.arguments | tojson + '}' }}{{- "<|eot_id|>" }}
    {%- elif message.role in ["ipython", "tool"] %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping %}{{- message.content | tojson }}{%- else %}{{- message.content }}{%- endif %}
        {{- "<|eot_id|>" }}
    {%- else %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
"""

QWEN_STYLE = """\
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and not message.content.startswith('<tool_response>') %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == "system" and not loop.first %}{% continue %}{% endif %}
    {%- set content = message.content %}
    {%- if message.role == "assistant" and '</think>' in content %}
        {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
    {%- endif %}
    {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
    {%- if loop.index0 > 20 %}{% break %}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
{%- generation %}{{- '' }}{%- endgeneration %}
"""

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather <now>",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
TOOL_CHAT = [
    {"role": "system", "content": "You can call tools."},
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
    {"role": "tool", "content": {"temperature": 21, "unit": "°C"}},
]
QWEN_CHAT = [
    {"role": "system", "content": "sys"},
    {"role": "user", "content": "first"},
    {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nanswer"},
    {"role": "user", "content": "second"},
]


def _hf_render(model_dir: Path, messages: list, **kwargs) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir).apply_chat_template(messages, tokenize=False, **kwargs)


def _with_template(tiny_dir: Path, tmp_path: Path, *, config_value=None, extra_files=None) -> Path:
    """A copy of the tiny checkpoint whose chat template lives somewhere other than chat_template.jinja."""
    model_dir = Path(shutil.copytree(tiny_dir, tmp_path / "model"))
    (model_dir / "chat_template.jinja").unlink()
    if config_value is not None:
        config = json.loads((model_dir / "tokenizer_config.json").read_text())
        (model_dir / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": config_value}))
    if extra_files is not None:
        (model_dir / "additional_chat_templates").mkdir()
        for name, source in extra_files.items():
            (model_dir / "additional_chat_templates" / f"{name}.jinja").write_text(source)
    return model_dir


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_builtin_template_renders_as_transformers(
    tokenizer: Tokenizer, hf_tokenizer, messages: list, add_generation_prompt: bool
) -> None:
    ours = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == theirs
    # Encoded without a second BOS, as transformers' tokenize=True does.
    ids = hf_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert tokenizer.encode(ours, add_bos=False) == list(ids)


def test_builtin_template_shape(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.apply_chat_template([{"role": "system", "content": "S"}, {"role": "user", "content": " U "}])
    assert prompt == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nU<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    ids = tokenizer.encode(prompt, add_bos=False)
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1


def test_llama_style_template_from_tokenizer_config(tiny_dir: Path, tmp_path: Path) -> None:
    model_dir = _with_template(tiny_dir, tmp_path, config_value=LLAMA_STYLE)
    ours = Tokenizer.from_dir(model_dir)
    for messages in CONVERSATIONS[:3] + [TOOL_CHAT]:
        for kwargs in ({}, {"tools": TOOLS}, {"date_string": "26 Jul 2024"}):
            assert ours.apply_chat_template(messages, **kwargs) == _hf_render(
                model_dir, messages, add_generation_prompt=True, **kwargs)


def test_qwen_style_template_from_additional_chat_templates(tiny_dir: Path, tmp_path: Path) -> None:
    # Template files win over tokenizer_config.json's entry.
    model_dir = _with_template(tiny_dir, tmp_path, config_value="ignored", extra_files={"default": QWEN_STYLE})
    ours = Tokenizer.from_dir(model_dir)
    for kwargs in ({}, {"enable_thinking": False}, {"enable_thinking": True}):
        assert ours.apply_chat_template(QWEN_CHAT, **kwargs) == _hf_render(
            model_dir, QWEN_CHAT, add_generation_prompt=True, **kwargs)
    assert "hmm" not in ours.apply_chat_template(QWEN_CHAT)
    assert ours.apply_chat_template(QWEN_CHAT, enable_thinking=False).endswith("<think>\n\n</think>\n\n")


def test_named_templates_pick_tool_use_when_tools_are_given(tiny_dir: Path, tmp_path: Path) -> None:
    named = [{"name": "default", "template": "{{ messages[0].content }}|plain"},
             {"name": "tool_use", "template": "{{ messages[0].content }}|{{ tools | length }} tools"}]
    model_dir = _with_template(tiny_dir, tmp_path, config_value=named)
    ours = Tokenizer.from_dir(model_dir)
    chat = [{"role": "user", "content": "q"}]
    assert ours.apply_chat_template(chat) == "q|plain" == _hf_render(model_dir, chat)
    assert ours.apply_chat_template(chat, tools=TOOLS) == "q|1 tools" == _hf_render(model_dir, chat, tools=TOOLS)
    assert ours.apply_chat_template(chat, template_name="tool_use", tools=[]) == "q|0 tools"
    with pytest.raises(ValueError, match="no chat template named"):
        ours.apply_chat_template(chat, template_name="nope")


def test_template_errors_are_value_errors(tokenizer: Tokenizer) -> None:
    with pytest.raises(ValueError, match="unsupported role tool"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}])
    with pytest.raises(ValueError, match="only text content parts"):
        tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}])
    with pytest.raises(ValueError, match="empty conversation"):
        tokenizer.apply_chat_template([])
    with pytest.raises(ValueError, match="unsupported value"):
        tokenizer.apply_chat_template([{"role": "user", "content": object()}])


def test_syntax_error_names_the_file(tiny_dir: Path, tmp_path: Path) -> None:
    model_dir = Path(shutil.copytree(tiny_dir, tmp_path / "model"))
    (model_dir / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}")
    with pytest.raises(ValueError, match="chat_template.jinja"):
        Tokenizer.from_dir(model_dir)


def test_no_template_is_a_clear_error(tiny_dir: Path, tmp_path: Path) -> None:
    model_dir = _with_template(tiny_dir, tmp_path)
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer.from_dir(model_dir).apply_chat_template([{"role": "user", "content": "x"}])


@pytest.mark.parametrize(
    "source",
    [
        "{{ messages.append({'role': 'x'}) }}",  # the environment is immutable
        "{{ ''.__class__.__mro__ }}",  # no Python internals
        "{% set ns = namespace(_secret=1) %}",  # no underscore attributes on namespaces
        "{{ raise_exception('refused by template') }}",
        "{{ 'text' + 1 }}",  # a Python TypeError inside the template
        "{{ messages[5].content }}",  # undefined: rendering its attribute fails
    ],
)
def test_sandbox_escapes_and_template_failures_are_value_errors(source: str) -> None:
    with pytest.raises(ValueError, match=r"^the chat template rejected the conversation: \w+(Error|Exception): "):
        ChatTemplate(source, {}).render([{"role": "user", "content": "x"}])


def test_a_rendering_error_names_no_server_file() -> None:
    """The message reaches the client: the template's file stays on the server."""
    template = ChatTemplate("{{ raise_exception('no system role') }}", {}, origin="/srv/models/secret/tokenizer_config.json")

    with pytest.raises(ValueError) as caught:
        template.render([{"role": "system", "content": "x"}])

    assert str(caught.value) == "the chat template rejected the conversation: TemplateError: no system role"


def test_keyword_arguments_override_special_tokens_and_none_keys_are_dropped() -> None:
    template = ChatTemplate(
        "{{ bos_token }}|{{ custom }}|{{ 'name' in messages[0] }}|{{ messages[0].content }}", {"bos_token": "<s>"}
    )
    rendered = template.render([{"role": "user", "content": "c", "name": None}], custom="k")
    assert rendered == "<s>|k|False|c"
    assert template.render([{"role": "user", "content": "c"}], bos_token="B", custom=1) == "B|1|False|c"
