"""Chat templates: find a checkpoint's Jinja template and render it exactly as transformers does.

The tokenizer actor must not import transformers (seconds and hundreds of MB), so we compile the
template ourselves with the same Jinja set-up transformers uses: a sandboxed, immutable
environment with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a
``tojson`` filter that does not HTML-escape, and the ``raise_exception`` and ``strftime_now``
globals. Templates come from model repositories, i.e. untrusted code, hence the sandbox.

Where the templates live (the files first, as transformers 5 reads them): ``chat_template.jinja``
and ``additional_chat_templates/<name>.jinja``; otherwise ``tokenizer_config.json["chat_template"]``
(a string, or a list of named templates). ``chat_template.json`` belongs to multimodal processors,
which AutoTokenizer does not read, and neither do we.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from types import MappingProxyType
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

DEFAULT_TEMPLATE_NAME = "default"
TOOL_USE_TEMPLATE_NAME = "tool_use"  # picked instead of the default when tools are passed


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks in
    transformers; for serving it only needs to render its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


class _SafeNamespace(jinja2.utils.Namespace):
    """``namespace()`` that refuses underscore names, so a template cannot reach Python internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _SafeNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _SafeNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat template may not set namespace attribute {name!r}")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes ('<' becomes \u003c), which would change the prompt.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _new_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _SafeNamespace
    return env


def _plain(value: Any, where: str) -> Any:
    """A copy made only of JSON types, so the template never sees (or mutates) caller objects."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {str(key): _plain(item, where) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item, where) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item, where) for item in value)
    raise ValueError(f"chat template input {where}: unsupported value of type {type(value).__name__}")


class ChatTemplate:
    """A compiled chat template plus the special-token strings it may refer to (``bos_token``...)."""

    def __init__(self, source: str, special_tokens: Mapping[str, str], *, origin: str = "chat template") -> None:
        """Compile ``source``; raise ValueError naming ``origin`` (the file) on a syntax error."""
        self.source = source
        self.origin = origin
        self.special_tokens: Mapping[str, str] = MappingProxyType(dict(special_tokens))
        try:
            self._compiled = _new_environment().from_string(source)
        except jinja2.exceptions.TemplateError as exc:
            raise ValueError(f"{origin}: cannot compile the chat template: {exc}") from exc

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render a conversation to the prompt text; raise ValueError if the template rejects it.

        Messages are dicts with ``role`` and ``content`` (plus whatever the template reads, such as
        ``tool_calls``); keys whose value is None are dropped, as transformers does, because many
        templates test for a key's presence. Extra keyword arguments (``enable_thinking``,
        ``date_string``...) are passed to the template and override the special tokens.
        """
        if not messages:
            raise ValueError("cannot apply a chat template to an empty conversation")
        chat = []
        for index, message in enumerate(messages):
            if not isinstance(message, Mapping):
                raise ValueError(f"message {index}: expected a mapping, got {type(message).__name__}")
            chat.append(_plain({k: v for k, v in message.items() if v is not None}, f"message {index}"))
        variables = {**self.special_tokens, **_plain(kwargs, "keyword arguments")}
        try:
            return self._compiled.render(
                messages=chat,
                tools=_plain(tools, "tools"),
                documents=_plain(documents, "documents"),
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except Exception as exc:  # untrusted code: a TemplateError, or a TypeError from `'a' + 1`...
            # The message goes to the client: it names the template's complaint, not its file.
            raise ValueError(f"the chat template rejected the conversation: {type(exc).__name__}: {exc}") from exc


def find_chat_templates(model_dir: Path, tokenizer_config: Mapping[str, Any]) -> dict[str, tuple[str, str]]:
    """All chat templates of a checkpoint as ``{name: (source, origin)}``; empty when it has none.

    As in transformers: template files (``chat_template.jinja``, named ``default``, and
    ``additional_chat_templates/<name>.jinja``) take priority over the templates in
    tokenizer_config.json, which may be one string (``default``) or a list of named templates.
    Raises ValueError naming the file when the config entry is malformed.
    """
    templates: dict[str, tuple[str, str]] = {}
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        templates[DEFAULT_TEMPLATE_NAME] = (jinja_file.read_text(encoding="utf-8"), str(jinja_file))
    extra_dir = model_dir / "additional_chat_templates"
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            templates.setdefault(path.stem, (path.read_text(encoding="utf-8"), str(path)))
    if templates:
        return templates
    origin = str(model_dir / "tokenizer_config.json")
    value = tokenizer_config.get("chat_template")
    if isinstance(value, str):
        templates[DEFAULT_TEMPLATE_NAME] = (value, origin)
    elif isinstance(value, list):
        for entry in value:
            if not (isinstance(entry, Mapping) and isinstance(entry.get("name"), str)
                    and isinstance(entry.get("template"), str)):
                raise ValueError(f"{origin}: chat_template entries must be {{'name': str, 'template': str}}")
            templates[entry["name"]] = (entry["template"], f"{origin} ({entry['name']})")
    elif value is not None:
        raise ValueError(f"{origin}: chat_template must be a string or a list of named templates")
    return templates
