"""The light tokenizer: what the tokenizer and detokenizer actors need, without torch or transformers.

``transformers.AutoTokenizer`` costs seconds and hundreds of MB per process because it pulls in
torch; the Rust ``tokenizers`` library it wraps loads in milliseconds. This module reads the same
files AutoTokenizer reads (``tokenizer.json``, ``tokenizer_config.json``,
``special_tokens_map.json``, ``generation_config.json``, the chat template) and behaves the same
for encode, decode and chat templates: tests compare it with transformers on our embedded model.

Only checkpoints that ship a ``tokenizer.json`` are supported (every Llama 3, Qwen and Mistral
checkpoint does); a SentencePiece-only checkpoint is a clear error.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

import tokenizers

from app.text.chat_template import DEFAULT_TEMPLATE_NAME, TOOL_USE_TEMPLATE_NAME, ChatTemplate, find_chat_templates

# The named special tokens transformers passes to chat templates (its SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``, or {} when the file does not exist; ValueError naming it otherwise."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _token_content(value: Any, path: Path, name: str) -> str | None:
    """A special token as written in tokenizer_config.json: a string, an AddedToken dict, or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"{path}: {name}: expected a string or {{'content': str}}, got {value!r}")


def _token_ids(value: Any, path: Path, name: str) -> list[int]:
    """``eos_token_id`` from a config: absent, one id, or a list of ids."""
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ValueError(f"{path}: {name}: expected a token id or a list of token ids, got {value!r}")
    return values


class Tokenizer:
    """Encode, decode and render chat templates for one checkpoint. Immutable once built."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        special_tokens: Mapping[str, str],
        eos_token_ids: Sequence[int] = (),
        chat_templates: Mapping[str, ChatTemplate] | None = None,
        source: str = "tokenizer",
    ) -> None:
        """Wrap a ``tokenizers.Tokenizer``; ``from_dir`` is the usual way in.

        ``special_tokens`` maps names (``bos_token``, ``eos_token``...) to token strings, each of
        which must be in the vocabulary; ``eos_token_ids`` adds ids that also end generation
        (``generation_config.json``'s list), after the ``eos_token``'s own id.
        """
        self._backend = backend
        self.source = source  # where it was loaded from, for error messages
        ids: dict[str, int] = {}
        for name, token in special_tokens.items():
            token_id = backend.token_to_id(token)
            if token_id is None:
                raise ValueError(f"{source}: {name} {token!r} is not in the vocabulary")
            ids[name] = token_id
        self.special_tokens: Mapping[str, str] = MappingProxyType(dict(special_tokens))
        self.bos_token_id: int | None = ids.get("bos_token")
        self.pad_token_id: int | None = ids.get("pad_token")
        # Every id that ends generation: the tokenizer's eos_token first, then generation_config's.
        eos = ([ids["eos_token"]] if "eos_token" in ids else []) + list(eos_token_ids)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos))
        self.chat_templates: Mapping[str, ChatTemplate] = MappingProxyType(dict(chat_templates or {}))

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Load a checkpoint's tokenizer; FileNotFoundError without tokenizer.json, ValueError
        (naming the file and field) for malformed configs or chat templates."""
        model_dir = Path(model_dir)
        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"{tokenizer_file}: not found; only checkpoints with a tokenizer.json (fast tokenizer) are supported"
            )
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the Rust loader raises a bare Exception
            raise ValueError(f"{tokenizer_file}: cannot load ({exc})") from exc

        config_file = model_dir / "tokenizer_config.json"
        config = _read_json(config_file)
        map_file = model_dir / "special_tokens_map.json"
        special_map = _read_json(map_file)
        special_tokens: dict[str, str] = {}
        for name in SPECIAL_TOKEN_NAMES:
            # tokenizer_config.json wins; special_tokens_map.json is the older place.
            path, raw = (config_file, config[name]) if name in config else (map_file, special_map.get(name))
            token = _token_content(raw, path, name)
            if token is not None:
                special_tokens[name] = token

        generation_file = model_dir / "generation_config.json"
        generation = _read_json(generation_file)
        if "eos_token_id" in generation:
            eos_ids = _token_ids(generation["eos_token_id"], generation_file, "eos_token_id")
        else:
            model_config_file = model_dir / "config.json"
            eos_ids = _token_ids(_read_json(model_config_file).get("eos_token_id"), model_config_file, "eos_token_id")

        templates = {
            name: ChatTemplate(source, special_tokens, origin=origin)
            for name, (source, origin) in find_chat_templates(model_dir, config).items()
        }
        return cls(
            backend,
            special_tokens=special_tokens,
            eos_token_ids=eos_ids,
            chat_templates=templates,
            source=str(model_dir),
        )

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (``len()`` of a transformers tokenizer).
        The model's embedding may be larger (padded); ids past this decode to nothing."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        """Token ids of ``text``. Special-token strings in ``text`` become special tokens.

        ``add_bos=None`` does what the checkpoint's tokenizer does by default (transformers'
        ``add_special_tokens=True``, i.e. tokenizer.json's post-processor: BOS for Llama 3,
        nothing for Qwen; transformers 5 ignores ``add_bos_token`` in tokenizer_config.json for
        such tokenizers, and so do we); ``True`` puts exactly one
        BOS first (ValueError without a BOS token); ``False`` adds nothing, which is right for a
        prompt rendered by a chat template, since the template writes its own BOS.
        """
        if add_bos is None:
            return self._backend.encode(text, add_special_tokens=True).ids
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_bos:
            if self.bos_token_id is None:
                raise ValueError(f"{self.source}: add_bos=True but the tokenizer has no bos_token")
            ids.insert(0, self.bos_token_id)
        return ids

    def encode_batch(self, texts: Sequence[str], *, add_bos: bool | None = None) -> list[list[int]]:
        """``encode`` of several texts at once (the Rust library spreads them over threads)."""
        if add_bos is None:
            return [e.ids for e in self._backend.encode_batch(list(texts), add_special_tokens=True)]
        encoded = [e.ids for e in self._backend.encode_batch(list(texts), add_special_tokens=False)]
        if add_bos:
            if self.bos_token_id is None:
                raise ValueError(f"{self.source}: add_bos=True but the tokenizer has no bos_token")
            for ids in encoded:
                ids.insert(0, self.bos_token_id)
        return encoded

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Text of ``token_ids``; incomplete UTF-8 at either end decodes to U+FFFD (see
        ``IncrementalDetokenizer`` for streaming)."""
        return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_name: str | None = None,
        **kwargs: Any,
    ) -> str:
        """Render a conversation to prompt text, as transformers' ``apply_chat_template(...,
        tokenize=False)`` does. Encode the result with ``add_bos=False``.

        Raises ValueError when the checkpoint has no chat template, ``template_name`` is unknown,
        or the template rejects the messages (its ``raise_exception``, or a Jinja error).
        """
        template = self._pick_template(template_name, tools)
        return template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs)

    def _pick_template(self, name: str | None, tools: Sequence[Mapping[str, Any]] | None) -> ChatTemplate:
        if not self.chat_templates:
            raise ValueError(f"{self.source}: this checkpoint has no chat template")
        if name is not None:
            if name not in self.chat_templates:
                raise ValueError(f"{self.source}: no chat template named {name!r}; have {sorted(self.chat_templates)}")
            return self.chat_templates[name]
        if tools is not None and TOOL_USE_TEMPLATE_NAME in self.chat_templates:
            return self.chat_templates[TOOL_USE_TEMPLATE_NAME]
        if DEFAULT_TEMPLATE_NAME in self.chat_templates:
            return self.chat_templates[DEFAULT_TEMPLATE_NAME]
        raise ValueError(
            f"{self.source}: several chat templates and no default; pass template_name, one of {sorted(self.chat_templates)}"
        )

