"""Command-line flags declared once, as the fields of a frozen dataclass.

A field made with :func:`flag` carries its help text (and choices); :func:`add_flags` derives the
argparse arguments from such fields and :func:`flag_values` reads them back, so the server's
parser (app/server_args.py), the engine's configuration (app/engine/config.py) and the tools'
parsers (tools/bench_offline.py, tools/profile_decode.py) are one declaration. The flag of a
field is its name with ``-`` for ``_``; its type comes from the annotation:

- ``bool`` (default False): a switch, ``--name`` sets it;
- ``int``, ``float``, ``str`` (or ``... | None``): ``--name VALUE``;
- a field declared with ``repeat=True`` may be given several times; its values are joined
  with commas (``--kernel-options a=1 --kernel-options b=2`` is ``"a=1,b=2"``).

Fields without :func:`flag` (internal settings) get no flag.
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Collection
from dataclasses import MISSING, field, fields
from typing import Any

_HELP = "help"


def flag(default: Any, help: str, *, choices: tuple[str, ...] | None = None, metavar: str | None = None,
         repeat: bool = False) -> Any:
    """A dataclass field that is also a command-line flag (see the module docstring)."""
    return field(default=default, metadata={_HELP: help, "choices": choices, "metavar": metavar, "repeat": repeat})


def flag_fields(cls: type) -> list[Any]:
    """The fields of dataclass ``cls`` that are flags, in declaration order."""
    return [f for f in fields(cls) if _HELP in f.metadata]


def _value_type(annotation: Any) -> type:
    """``int`` for ``int`` or ``int | None``, and so on."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        (kind,) = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        return kind
    return annotation


def add_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type, *,
              skip: Collection[str] = ()) -> None:
    """One argparse argument for each flag field of ``cls`` except those named in ``skip``."""
    hints = typing.get_type_hints(cls)
    for f in flag_fields(cls):
        if f.name in skip:
            continue
        name = "--" + f.name.replace("_", "-")
        help_text, choices, metavar = f.metadata[_HELP], f.metadata["choices"], f.metadata["metavar"]
        kind = _value_type(hints[f.name])
        default = None if f.default is MISSING else f.default
        if kind is bool:
            parser.add_argument(name, action="store_true", help=help_text)
        elif f.metadata["repeat"]:
            parser.add_argument(name, action="append", default=None, metavar=metavar, help=help_text)
        else:
            parser.add_argument(name, type=kind if kind in (int, float) else str, default=default, choices=choices,
                                metavar=metavar or ("N" if kind is int else None), help=help_text)


def flag_values(namespace: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The parsed values of ``cls``'s flags, as keyword arguments of ``cls`` (repeated flags joined)."""
    values: dict[str, Any] = {}
    for f in flag_fields(cls):
        if not hasattr(namespace, f.name):
            continue
        value = getattr(namespace, f.name)
        if f.metadata["repeat"]:
            value = ",".join(value) if value else f.default
        values[f.name] = value
    return values


class HelpWithDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """Show a flag's default, unless it is None, False or empty (its help then says what happens)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, False, ""):
            return action.help or ""
        return super()._get_help_string(action) or ""
